#!/bin/bash
# usage: cpu_counters.sh OUT [bench args...]  -- per-thread CPU of the stack's processes during one bench run
# (the tree measured: TREE, default the checkout this script sits in; run nothing else meanwhile)
OUT=$(realpath -m "$1"); shift; rm -rf $OUT; mkdir -p $OUT
TREE=${TREE:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)}
cd $TREE
(PYTHONPATH=$TREE timeout 900 .venv/bin/python -m bench "$@" --out $OUT/out > $OUT/log 2>&1; echo done > $OUT/finished) &
for i in $(seq 120); do grep -q "bench:" $OUT/log 2>/dev/null && break; sleep 1; done
ps -eo pid,args | grep -E "python -m services\.(target|draft|gateway)" | grep -v grep | awk '{print $1, $4}' > $OUT/pids
snapt() { for p in $(awk '{print $1}' $OUT/pids); do for t in /proc/$p/task/*; do v=$(awk '{print $14+$15}' $t/stat 2>/dev/null) || return 1; echo "$p $(basename $t) $(cat $t/comm 2>/dev/null| tr ' ' _) $v"; done; done; }
snapt > $OUT/start; date +%s.%N > $OUT/t0
while [ ! -f $OUT/finished ]; do snapt > $OUT/end.tmp 2>/dev/null && [ $(wc -l < $OUT/end.tmp) -ge $(wc -l < $OUT/start) ] && mv $OUT/end.tmp $OUT/end && date +%s.%N > $OUT/t1; sleep 0.3; done
python3 - $OUT <<'PY'
import sys, collections
o=sys.argv[1]
s={tuple(l.split()[:3]):int(l.split()[3]) for l in open(o+'/start')}
e={tuple(l.split()[:3]):int(l.split()[3]) for l in open(o+'/end')}
names={l.split()[0]:l.split()[1] for l in open(o+'/pids')}
agg=collections.Counter()
for k in sorted(e):
    d=e[k]-s.get(k,0)
    if d>0: print(names[k[0]], k, d)
    agg[(k[0],names[k[0]])]+=d
print(dict(agg))
PY
