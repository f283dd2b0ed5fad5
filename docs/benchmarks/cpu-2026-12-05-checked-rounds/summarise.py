"""One line per run of an A/B and row: the n-gram service's speedup over target-only, its overhead share and
efficiency (the report's own figures), and the share of its rounds that were checked.
`python summarise.py [folder]`: the runs in `folder` (default: this one's),
e.g. ../cpu-2026-12-05-service-match-policy"""

import json
import pathlib
import sys

here = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else pathlib.Path(__file__).parent
workloads = ["edit", "summary", "chat", "json", "edit-t0.7", "chat-t0.7"]
print("| run | " + " | ".join(workloads) + " |")
print("|---|" + "---|" * len(workloads))
for run in sorted(p for p in here.iterdir() if (p / "results.json").exists()):
    data = json.loads((run / "results.json").read_text())
    rows = {(r["config"], r["workload"]): r for r in data["rows"]}
    checked: dict[str, list[int]] = {}
    for rec in data["records"]:
        t = rec.get("timings") or {}
        if rec["config"].startswith("ngram-service") and t.get("rounds"):
            c = checked.setdefault(rec["workload"], [0, 0])
            c[0] += t.get("checked_rounds", 0)
            c[1] += t["rounds"]
    cells = []
    for w in workloads:
        r = next((v for (c, wl), v in rows.items() if wl == w and c.startswith("ngram-service")), None)
        if r is None:
            cells.append("-")
            continue
        share = checked[w][0] / checked[w][1] if w in checked and checked[w][1] else 0.0
        cells.append(f"{r['speedup']:.2f}x, {r['overhead_pct']:.1f}%, eff {r['efficiency']:.2f}, chk {share:.0%}")
    print(f"| {run.name} | " + " | ".join(cells) + " |")
