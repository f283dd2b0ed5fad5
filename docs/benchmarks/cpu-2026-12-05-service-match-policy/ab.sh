# The n-gram draft service at adaptive k <= 32 (what `make run` serves), chosen by the position-based draft-length
# policy (BEFORE: a tree at 06be5c4) against the match-length policy with the service's Proposal.match_len (AFTER: a
# tree with the change), target-only beside each; two runs of each, alternating. Writes <before|after>_<run>/ next to
# this script. Usage: bash ab.sh /path/to/before-tree /path/to/after-tree (each with tandem/v1 generated).
set -u
here=$(cd "$(dirname "$0")" && pwd)
before=$1 after=$2
for run in 1 2; do
  for side in before after; do
    tree=$before; [ "$side" = after ] && tree=$after
    (cd "$tree" && PYTHONPATH="$tree" /work/main/.venv/bin/python -m bench \
      --reps 2 --ks 8 --ngram-ks 32 --no-model-draft --long-match 0 \
      --only '^(target-only|ngram-service adaptive<=32)$' \
      --out "$here/${side}_$run" > "/tmp/policy_${side}_$run.log" 2>&1)
  done
done
