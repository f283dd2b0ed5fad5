"""One line per run and configuration of an A/B: speedup over target-only (target-only: its decode tok/s, how fast
the shared host was in that run) and overhead share, the report's own figures, on each workload.
`python summarise.py uds` or `python summarise.py sched-batch` (a folder of runs, listed by name, not in the
order they ran)."""

import json
import pathlib
import sys

here = pathlib.Path(sys.argv[1])
runs = sorted(p for p in here.iterdir() if (p / "results.json").exists())
rows_by_run = {run.name: json.loads((run / "results.json").read_text())["rows"] for run in runs}
workloads = list(dict.fromkeys(r["workload"] for rows in rows_by_run.values() for r in rows))
print("| run | config | " + " | ".join(workloads) + " |")
print("|---|---|" + "---|" * len(workloads))
for name, rows in rows_by_run.items():
    cell = {(r["config"], r["workload"]): r for r in rows}
    for config in dict.fromkeys(r["config"] for r in rows):
        figures = [cell.get((config, w)) for w in workloads]
        plain = config == "target-only"
        text = ["-" if r is None else f"{r['tok_s']:.1f} tok/s" if plain else f"{r['speedup']:.2f}x" for r in figures]
        text = [f"{t}, {r['overhead_pct']:.1f}%" if r else t for t, r in zip(text, figures, strict=True)]
        print(f"| {name} | {config} | " + " | ".join(text) + " |")
