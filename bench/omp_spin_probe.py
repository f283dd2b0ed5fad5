"""`python -m bench.omp_spin_probe [IDLE_MS]`: CPU time a llama.cpp process burns while idle after a forward pass.

llama.cpp's CPU backend runs each forward pass as one OpenMP parallel region. When the region ends, libgomp's worker
threads spin-wait for the next one (GOMP_SPINCOUNT iterations, 300,000 by default when threads do not outnumber
cores) before they sleep. This probe decodes one token at a time with IDLE_MS of sleep after each and reports the
forward time and the CPU the process used during the sleep, from /proc (clock ticks, so averages over 30 steps).
Run it with and without GOMP_SPINCOUNT set to compare.
"""

from __future__ import annotations

import os
import sys
import time

from bench.procstat import cpu_ticks
from tandem.config import EngineSettings
from tandem.engine import DecodeItem, Engine


def thread_cpu_ticks() -> dict[str, int]:
    """utime + stime of every thread of this process, in clock ticks."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        out[tid] = cpu_ticks(f"/proc/self/task/{tid}/stat")
    return out


def main(argv: list[str]) -> int:
    idle_ms = float(argv[0]) if argv else 20.0
    engine = Engine(EngineSettings(n_threads=2, n_ctx=2048, max_sessions=1))
    prompt = list(range(100, 160))
    engine.decode([DecodeItem(0, prompt, 0, "last")])
    position = len(prompt)
    tick_s = 1.0 / os.sysconf("SC_CLK_TCK")
    steps = 30
    for _ in range(3):
        burned = forward = 0.0
        for i in range(steps):
            t0 = time.perf_counter()
            engine.decode([DecodeItem(0, [200 + i], position, "last")])
            forward += time.perf_counter() - t0
            position += 1
            before = thread_cpu_ticks()
            time.sleep(idle_ms / 1000)
            after = thread_cpu_ticks()
            burned += sum(after.get(t, 0) - v for t, v in before.items()) * tick_s
        print(
            f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'default')}: forward {1000 * forward / steps:.2f} ms,"
            f" CPU used during {idle_ms:g} ms idle: {1000 * burned / steps:.2f} ms a step",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
