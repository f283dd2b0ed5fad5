#!/bin/bash
# usage: bash ab.sh  -- the n-gram draft service at k = 8 with the lookup rounds' follow-up calls (default) and
# without (a copy of the checkout with FOLLOW_UP_MIN_MISS = 2.0 in services/gateway/adaptive.py: never sent),
# two runs a side, alternating. Folders under $OUT (default /tmp/follow-ups);
# `python ../cpu-2026-12-05-grpc-io/summarise.py $OUT/*_?` prints their rows.
set -u
OUT=${OUT:-/tmp/follow-ups}; mkdir -p "$OUT"
TREE=$(git -C "$(dirname "$0")" rev-parse --show-toplevel) || exit 2
COPY=$OUT/tree
git -C "$TREE" worktree add -f --detach "$COPY" HEAD > /dev/null
mkdir -p "$COPY/tandem/v1" && cp "$TREE"/tandem/v1/*.py "$TREE"/tandem/v1/*.pyi "$COPY/tandem/v1/"
sed -i 's/^FOLLOW_UP_MIN_MISS = 0.35/FOLLOW_UP_MIN_MISS = 2.0/' "$COPY/services/gateway/adaptive.py"
for run in fu_1 nofu_1 fu_2 nofu_2; do
  if [[ $run == nofu* ]]; then T=$COPY; else T=$TREE; fi
  (cd "$T" && PYTHONPATH=$T "$TREE/.venv/bin/python" -m bench --only '^ngram-service k=8$' \
    --workloads json,edit-t0.7,chat-t0.7 --reps 3 --ks 8 --no-model-draft --no-adaptive --out "$OUT/$run" \
    > "$OUT/$run.log" 2>&1)
done
git -C "$TREE" worktree remove --force "$COPY"
