import json, glob, collections
for f in sorted(glob.glob("docs/benchmarks/cpu-2026-12-04-omp-spin-quiet/*/results.json")):
    d = json.load(open(f)); rows = d.get("rows") or d.get("summary")
    by = {(r["config"], r["workload"]): r for r in rows}
    line = []
    for c in ("target-only", "ngram k=8", "ngram-service k=8"):
        line.append(c.split()[0][:8] + " " + " ".join(f"{by[(c,w)]['overhead_pct']:.1f}" for w in ("json","chat","edit-t0.7","summary")))
    tok = " ".join(f"{by[('target-only',w)]['tok_s']:.0f}" for w in ("json","chat","edit-t0.7","summary"))
    svc = " ".join(f"{by[('ngram-service k=8',w)]['speedup']:.2f}" for w in ("json","chat","edit-t0.7","summary"))
    print(f.split("/")[-2], " | ".join(line), "| t-only tok/s", tok, "| svc speedup", svc)
