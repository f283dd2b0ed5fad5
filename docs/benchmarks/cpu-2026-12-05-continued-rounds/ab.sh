# The n-gram service at k = 8 and at adaptive k <= 32, target-only beside them, two runs of each of two trees,
# alternating. Writes <name>_<run>/ next to this script.
# Usage: bash ab.sh NAME_A /path/to/tree-a NAME_B /path/to/tree-b (each tree with tandem/v1 generated), e.g.
#   bash ab.sh before /tmp/ab-before after /tmp/ab-after   (950ddb0 against the continued rounds)
#   bash ab.sh gated /tmp/ab-after wide /tmp/ab-wide       (continued where a follow-up would go, against every round)
set -u
here=$(cd "$(dirname "$0")" && pwd)
name_a=$1 tree_a=$2 name_b=$3 tree_b=$4
for run in 1 2; do
  for side in a b; do
    if [ "$side" = a ]; then name=$name_a tree=$tree_a; else name=$name_b tree=$tree_b; fi
    (cd "$tree" && PYTHONPATH="$tree" timeout 1200 /work/main/.venv/bin/python -m bench \
      --reps 2 --ks 8 --ngram-ks 32 --no-model-draft --long-match 0 \
      --only '^(target-only|ngram-service k=8|ngram-service adaptive<=32)$' \
      --out "$here/${name}_$run" > "/tmp/continued_${name}_$run.log" 2>&1)
  done
done
