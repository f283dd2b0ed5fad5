#!/bin/bash
# usage: ab.sh OUTROOT ; alternates the tcp and batch arms, twice
set -u
ROOT=$(realpath -m "$1"); mkdir -p "$ROOT"  # arms: copies of the tree at /tmp/ab-tcp and /tmp/ab-batch (sched-batch.patch applied)
for round in 1 2; do
  for arm in tcp batch; do
    cd /tmp/ab-$arm
    if [ $arm = batch ]; then export TANDEM_SCHED_BATCH=1; else unset TANDEM_SCHED_BATCH; fi
    PYTHONPATH=/tmp/ab-$arm timeout 1200 .venv/bin/python -m bench --only '^ngram-service' --workloads json,edit-t0.7,chat-t0.7,chat --reps 3 --ks 8 --ngram-ks 32 --no-model-draft --out $ROOT/$arm-$round > $ROOT/$arm-$round.log 2>&1
    echo "$arm-$round rc=$? $(date +%T)" >> $ROOT/progress
  done
done
