"""One line per run of the branches A/B: the n-gram draft service's overhead %, speedup and calls, per workload."""

import glob
import json
import sys
from collections import defaultdict
from pathlib import Path

WORKLOADS = ("edit", "summary", "chat", "json", "edit-t0.7", "chat-t0.7")
SERVICE = "ngram-service k=8"

folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
for path in sorted(glob.glob(str(folder / "*" / "results.json"))):
    data = json.loads(Path(path).read_text())
    by = {(r["config"], r["workload"]): r for r in data.get("rows") or data.get("summary")}
    calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for record in data["records"]:
        if record["config"] == SERVICE:
            for key in ("propose_calls", "branch_rounds", "proposes_skipped", "lookahead_rounds", "rounds"):
                calls[record["workload"]][key] += record["timings"].get(key, 0) or 0
    overhead = " ".join(f"{by[(SERVICE, w)]['overhead_pct']:.1f}" for w in WORKLOADS)
    speedup = " ".join(f"{by[(SERVICE, w)]['speedup']:.2f}" for w in WORKLOADS)
    local = " ".join(f"{by[('ngram k=8', w)]['overhead_pct']:.1f}" for w in WORKLOADS)
    plain = " ".join(f"{by[('target-only', w)]['overhead_pct']:.1f}" for w in WORKLOADS)
    propose = sum(c["propose_calls"] for c in calls.values())
    branch = sum(c["branch_rounds"] for c in calls.values())
    rounds = sum(c["rounds"] for c in calls.values())
    skipped = sum(c["proposes_skipped"] for c in calls.values())
    print(
        f"{Path(path).parent.name}: service overhead {overhead} | speedup {speedup} | Propose {propose}, branch rounds"
        f" {branch}, skipped {skipped}, rounds {rounds} | local {local} | target-only {plain}"
    )
