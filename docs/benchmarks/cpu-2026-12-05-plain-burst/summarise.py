"""One line per run of `ab.sh`: target-only tok/s against llama-server's plain tok/s (geometric mean over the
(prompt, repetition) units, as the report's own table), and the forward time per token, for each workload.
`python summarise.py`"""

import collections
import json
import math
import pathlib

here = pathlib.Path(__file__).parent
workloads = ["chat", "edit", "json"]
for run in sorted(p for p in here.iterdir() if (p / "results.json").exists()):
    data = json.loads((run / "results.json").read_text())
    versus = {(v["workload"], v["baseline"]): v for v in data["plain_versus"]}
    fwd: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    calls: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for rec in data["records"]:
        t = rec.get("timings") or {}
        if t.get("verify_compute_ms") and t.get("predicted_n"):
            fwd[rec["config"], rec["workload"]].append(t["verify_compute_ms"] / t["predicted_n"])
            calls[rec["config"], rec["workload"]].append(t["predicted_n"] / t["verify_calls"])
    parts = []
    for config in ("target-only", "co-located target-only"):
        ratios = " ".join(f"{versus[w, config]['ratio']:.2f}" for w in workloads)
        ms = " ".join(f"{math.fsum(fwd[config, w]) / len(fwd[config, w]):.2f}" for w in workloads)
        per_call = " ".join(f"{math.fsum(calls[config, w]) / len(calls[config, w]):.1f}" for w in workloads)
        parts.append(f"{config}: vs llama-server {ratios}, forward ms/token {ms}, tokens/call {per_call}")
    print(f"{run.name:6s} " + " | ".join(parts))
