"""One line per run of the A/B: overhead % (json, chat, edit-t0.7, summary), target-only tok/s, service speedups.

`python summarise.py [FOLDER]`: the runs in FOLDER's subfolders (default: this script's folder)."""

import glob
import json
import sys
from pathlib import Path

WORKLOADS = ("json", "chat", "edit-t0.7", "summary")
CONFIGS = ("target-only", "ngram k=8", "ngram-service k=8")

folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
for path in sorted(glob.glob(str(folder / "*" / "results.json"))):
    data = json.loads(Path(path).read_text())
    by = {(r["config"], r["workload"]): r for r in data.get("rows") or data.get("summary")}
    overhead = " | ".join(
        c.split()[0][:8] + " " + " ".join(f"{by[(c, w)]['overhead_pct']:.1f}" for w in WORKLOADS) for c in CONFIGS
    )
    tok_s = " ".join(f"{by[('target-only', w)]['tok_s']:.0f}" for w in WORKLOADS)
    speedup = " ".join(f"{by[('ngram-service k=8', w)]['speedup']:.2f}" for w in WORKLOADS)
    print(Path(path).parent.name, overhead, "| t-only tok/s", tok_s, "| svc speedup", speedup)
