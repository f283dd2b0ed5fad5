#!/bin/bash
# usage: bash ab.sh [1t]  -- gRPC's EventEngine I/O (grpcio's default since 1.80) against the poller it replaced,
# two runs a side, alternating; `1t`: the target on one thread, leaving a core to the gateway and the draft service.
# Folders under $OUT (default /tmp/grpc-io); `python summarise.py $OUT/*_?` prints the rows of the README.
set -u
OUT=${OUT:-/tmp/grpc-io}; mkdir -p "$OUT"
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)" || exit 2
if [ "${1:-}" = 1t ]; then
  TAG=1t; EXTRA=(--workloads json,chat --target-args "--n-threads 1")
else
  TAG=; EXTRA=(--workloads json,edit-t0.7,chat-t0.7,chat)
fi
for run in ee${TAG}_1 legacy${TAG}_1 ee${TAG}_2 legacy${TAG}_2; do
  if [[ $run == legacy* ]]; then export GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener; else unset GRPC_EXPERIMENTS; fi
  .venv/bin/python -m bench --only '^ngram-service' "${EXTRA[@]}" --reps 3 --ks 8 --ngram-ks 32 --no-model-draft \
    --out "$OUT/$run" > "$OUT/$run.log" 2>&1
done
