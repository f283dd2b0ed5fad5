"""One line per run and configuration: overhead % per workload, and the draft and target services' time outside their
forward passes per round (from each request's timings), for `ab.sh`'s folders. `python summarise.py`"""

import collections
import json
import pathlib

here = pathlib.Path(__file__).parent
workloads = ["edit-t0.7", "chat-t0.7"]
for run in sorted(p for p in here.iterdir() if (p / "results.json").exists()):
    data = json.loads((run / "results.json").read_text())
    overhead = {(r["config"], r["workload"]): r["overhead_pct"] for r in data["rows"]}
    sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for rec in data["records"]:
        t = rec.get("timings") or {}
        s = sums[rec["config"]]
        for key in ("rounds", "draft_service_ms", "draft_compute_ms", "verify_service_ms", "verify_compute_ms"):
            s[key] += t.get(key) or 0
    for config in ("target-only", "model k=4", "model k=8"):
        s = sums[config]
        line = f"{run.name:6s} {config:12s} overhead " + " ".join(f"{overhead[config, w]:5.1f}" for w in workloads)
        if s["rounds"]:
            draft = (s["draft_service_ms"] - s["draft_compute_ms"]) / s["rounds"]
            target = (s["verify_service_ms"] - s["verify_compute_ms"]) / s["rounds"]
            line += f" | per round: draft service outside forward {draft:.3f} ms, target {target:.3f} ms"
            line += f" ({s['rounds']} rounds)"
        print(line)
