#!/bin/bash
# usage: ab.sh OUTROOT ; alternates the tcp and uds arms, twice
set -u
ROOT=$(realpath -m "$1"); mkdir -p "$ROOT"  # arms: copies of the tree at /tmp/ab-tcp and /tmp/ab-uds (uds.patch applied)
for round in 1 2; do
  for arm in tcp uds; do
    cd /tmp/ab-$arm
    if [ $arm = uds ]; then export TANDEM_UDS_DIR=/tmp/udsdir; rm -rf $TANDEM_UDS_DIR; mkdir -p $TANDEM_UDS_DIR; else unset TANDEM_UDS_DIR; fi
    PYTHONPATH=/tmp/ab-$arm timeout 1200 .venv/bin/python -m bench --only '^ngram-service' --workloads json,edit-t0.7,chat-t0.7,chat --reps 3 --ks 8 --ngram-ks 32 --no-model-draft --out $ROOT/$arm-$round > $ROOT/$arm-$round.log 2>&1
    echo "$arm-$round rc=$? $(date +%T)" >> $ROOT/progress
    [ $arm = uds ] && ls $TANDEM_UDS_DIR >> $ROOT/progress
  done
done
