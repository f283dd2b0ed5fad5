"""python summarise.py RUN_FOLDER...: target-only and the n-gram service rows of each run (tok/s, speedup, overhead)."""

import json
import sys

for run in sys.argv[1:]:
    with open(f"{run}/results.json") as f:
        rows = json.load(f)["rows"]
    print("==", run)
    for r in rows:
        if r["config"].startswith("ngram-service") or r["config"] == "target-only":
            print(
                f"  {r['config']:28s} {r['workload']:10s} tok/s {r['tok_s']:6.1f} x{r['speedup']:.2f}"
                f" overhead {r['overhead_pct']:5.1f}% eff {r['efficiency']:.3f}"
            )
