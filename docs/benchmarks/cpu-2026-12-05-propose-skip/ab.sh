# The gateway before (a tree at e447bc2) and after be2db3d (no Propose where an n-gram service could only answer
# empty), the n-gram service at k = 8 and at adaptive k <= 32 with target-only beside them; two runs of each,
# alternating. Writes <before|after>_<run>/ next to this script.
# Usage: bash ab.sh /path/to/before-tree /path/to/after-tree (each with tandem/v1 generated).
set -u
here=$(cd "$(dirname "$0")" && pwd)
before=$1 after=$2
for run in 1 2; do
  for side in before after; do
    tree=$before; [ "$side" = after ] && tree=$after
    (cd "$tree" && PYTHONPATH="$tree" timeout 1200 /work/main/.venv/bin/python -m bench \
      --reps 2 --ks 8 --ngram-ks 32 --no-model-draft --long-match 0 \
      --only '^(target-only|ngram-service k=8|ngram-service adaptive<=32)$' \
      --out "$here/${side}_$run" > "/tmp/propose_skip_${side}_$run.log" 2>&1)
  done
done
