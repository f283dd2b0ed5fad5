"""python propose_timeline.py TRACE_DIR: where a Propose's time goes, from the probe's per-process event files.

Events (propose-timeline.patch): G1 the gateway queues the call, G2 its writer task starts the gRPC write, G3 the
write completes, S1 the draft service reads the request, S2 its handler starts, S3 it ends, S4 the answer reaches
the stream's writer, G4 the gateway's reader has the answer, G5 the caller resumes. perf_counter_ns is the
monotonic clock, shared by the processes of one host. Matched by request id.
"""

import collections
import itertools
import statistics
import sys
from pathlib import Path

ORDER = ["G1", "G2", "G3", "S1", "S2", "S3", "S4", "G4", "G5"]
events: dict[tuple[str, int], dict[str, int]] = collections.defaultdict(dict)
for path in Path(sys.argv[1]).iterdir():
    with path.open() as f:
        for line in f:
            tag, request_id, t = line.split()
            name, step = tag.rsplit(".", 1)
            if name == "draft" or name.endswith("Draft/Propose"):
                events[(step[0], int(request_id))][step] = int(t)
segments = collections.defaultdict(list)
for (side, request_id), gateway in events.items():
    service = events.get(("S", request_id), {})
    t = {**gateway, **service}
    if side != "G" or any(step not in t for step in ORDER):
        continue
    for a, b in itertools.pairwise(ORDER):
        segments[f"{a}->{b}"].append((t[b] - t[a]) / 1e3)
    segments["G1->G5 (all)"].append((t["G5"] - t["G1"]) / 1e3)
print(f"{len(segments['G1->G5 (all)'])} Proposes")
for name, values in segments.items():
    print(f"  {name:14s} median {statistics.median(values):6.1f} us, mean {statistics.mean(values):6.1f} us")
