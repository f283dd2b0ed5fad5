"""CPU time of a process or a thread from Linux's /proc, for the probes that count what each side burns."""

from __future__ import annotations

import os


def cpu_ticks(stat_path: str) -> int:
    """utime + stime, in clock ticks, from a /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat file: the fields after
    the command name's last ')' (a name may hold spaces and parentheses), utime and stime the 12th and 13th there."""
    with open(stat_path) as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    return cpu_ticks(f"/proc/{pid}/stat") / os.sysconf("SC_CLK_TCK")
