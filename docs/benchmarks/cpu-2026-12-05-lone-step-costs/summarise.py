"""Per run of the A/B: speedup of the adaptive lookup over target-only by workload, and its drafts per request
(drafted / accepted / rounds with a draft, summed over the run's requests)."""

import glob
import json
from pathlib import Path

for path in sorted(glob.glob(str(Path(__file__).parent / "**" / "results.json"), recursive=True)):
    data = json.loads(Path(path).read_text())
    speedups = {r["workload"]: r["speedup"] for r in data["rows"] if r["config"] == "ngram adaptive<=32"}
    drafts: dict[str, list[int]] = {}
    for rec in data["records"]:
        if rec["config"] == "ngram adaptive<=32":
            t, d = rec["timings"], drafts.setdefault(rec["workload"], [0, 0, 0, 0])
            d[0] += t["draft_n"]
            d[1] += t["draft_n_accepted"]
            d[2] += t["rounds"]
            d[3] += 1
    cells = [
        f"{w} {speedups[w]:.2f}x ({d[0] / d[3]:.0f}/{d[1] / d[3]:.0f}/{d[2] / d[3]:.0f})" for w, d in drafts.items()
    ]
    print(f"{Path(path).parent.relative_to(Path(__file__).parent)!s:16}", " | ".join(cells))
