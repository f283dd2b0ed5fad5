#!/bin/bash
# usage: cpu_counters.sh OUT [bench args...]  -- CPU time of the stack's processes, and of each thread, during one
# bench run (TREE: the tree measured, default the checkout this script sits in). Run nothing else meanwhile.
# One awk a second reads the counters: a poll that starts processes of its own would use the cores it measures.
set -u
if [ -n "$(ls -A "$1" 2>/dev/null)" ]; then echo "$1 is not empty" >&2; exit 2; fi
OUT=$(realpath -m "$1"); shift; mkdir -p "$OUT"
TREE=${TREE:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}
cd "$TREE" || exit 2
(PYTHONPATH=$TREE timeout 900 .venv/bin/python -m bench "$@" --out "$OUT/out" > "$OUT/log" 2>&1; echo done > "$OUT/finished") &
for _ in $(seq 300); do grep -q "bench:" "$OUT/log" 2>/dev/null && break; [ -f "$OUT/finished" ] && break; sleep 1; done
ps -eo pid,args | grep -E "python -m services\.(target|draft|gateway)" | grep -v grep | awk '{print $1, $4}' > "$OUT/pids"
if [ ! -s "$OUT/pids" ]; then echo "no stack processes found (see $OUT/log)" >&2; exit 1; fi
PIDS=$(awk '{print $1}' "$OUT/pids")
files() { for p in $PIDS; do echo "/proc/$p/stat" /proc/"$p"/task/*/stat; done; }
# utime + stime in clock ticks; the fields after the last ')' (a thread name may hold spaces), utime the 12th there.
snap() {
  # shellcheck disable=SC2046
  awk '{ match($0, /.*\)/); split(substr($0, RLENGTH + 2), f, " "); print FILENAME, f[12] + f[13] }' $(files) 2>/dev/null
}
whole() { [ "$(grep -cE '^/proc/[0-9]+/stat ' "$1")" -eq "$(wc -l < "$OUT/pids")" ]; }
snap > "$OUT/start"; date +%s.%N > "$OUT/t0"
while [ ! -f "$OUT/finished" ]; do
  snap > "$OUT/end.tmp"; now=$(date +%s.%N)
  if whole "$OUT/end.tmp"; then mv "$OUT/end.tmp" "$OUT/end"; echo "$now" > "$OUT/t1"; fi
  sleep 1
done
python3 - "$OUT" <<'PY'
import sys
out = sys.argv[1]
names = dict(line.split() for line in open(f"{out}/pids"))
start = dict((k, int(v)) for k, v in (line.split() for line in open(f"{out}/start")))
end = dict((k, int(v)) for k, v in (line.split() for line in open(f"{out}/end")))
hz = 100
wall = float(open(f"{out}/t1").read()) - float(open(f"{out}/t0").read())
print(f"wall {wall:.1f} s between the snapshots (end: the last one before the stack stopped)")
for path in sorted(end):
    pid = path.split("/")[2]
    whole_process = path == f"/proc/{pid}/stat"
    used = (end[path] - start.get(path, 0)) / hz
    if whole_process or used >= 0.05:
        label = names[pid] + (" (process)" if whole_process else f" thread {path.split('/')[4]}")
        print(f"{label:40s} {used:7.2f} s CPU")
PY
