"""The probe of propose-timeline.patch, as tandem/_tr.py: one line per event, "<tag> <request id> <ns>", into
/tmp/trace/<pid> (create the folder first). Line-buffered: a process stopped by a signal keeps what it wrote."""

import os
import time

_out = open(f"/tmp/trace/{os.getpid()}", "w", buffering=1)  # noqa: SIM115 (open for the process's lifetime)


def ev(tag: str, request_id: int) -> None:
    _out.write(f"{tag} {request_id} {time.perf_counter_ns()}\n")
