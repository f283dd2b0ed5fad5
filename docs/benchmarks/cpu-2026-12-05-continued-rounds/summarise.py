"""Per run: the n-gram service rows' speedup, overhead share and calls per 100 tokens (P Propose, V Verify, S Proposes
skipped, C continued rounds, F follow-up calls); target-only's decode rate and overhead share."""

import json
import sys
from collections import defaultdict
from pathlib import Path

here = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
W = ["edit", "summary", "chat", "json", "edit-t0.7", "chat-t0.7"]
for run in sorted(p for p in here.iterdir() if (p / "results.json").exists()):
    d = json.loads((run / "results.json").read_text())
    rows = {(r["config"], r["workload"]): r for r in d["rows"]}
    agg = defaultdict(lambda: defaultdict(float))
    for rec in d["records"]:
        for k, v in rec["timings"].items():
            if isinstance(v, (int, float)):
                agg[(rec["config"], rec["workload"])][k] += v
    for cfg in ["target-only", "ngram-service k=8", "ngram-service adaptive<=32"]:
        cells = []
        for w in W:
            r, a = rows.get((cfg, w)), agg[(cfg, w)]
            if r is None:
                continue
            n = a["predicted_n"] / 100
            calls = " ".join(
                f"{letter}{a.get(key, 0) / n:.1f}"
                for letter, key in [
                    ("P", "propose_calls"),
                    ("V", "verify_calls"),
                    ("S", "proposes_skipped"),
                    ("C", "continued_rounds"),
                    ("F", "follow_ups"),
                ]
            )
            sp = f"{r['tok_s']:.0f} tok/s" if cfg == "target-only" else f"{r['speedup']:.2f}x"
            cells.append(f"{sp}, {r['overhead_pct']:.1f}%" + ("" if cfg == "target-only" else f" ({calls})"))
        print(f"| {run.name} | {cfg} | " + " | ".join(cells) + " |")
