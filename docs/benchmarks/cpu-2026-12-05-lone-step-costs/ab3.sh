# Three sides, two runs each, interleaved: before (the parent commit, $BEFORE), the cost fix alone ($COSTFIX: the
# step costs by size priced through plain stretches: this commit) and both ($BOTH: the fix and a MatchHistory, a
# tree not committed, see README).
# Writes <side>_<run>/ under runs3/ next to this script.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
for run in 1 2; do
  for side in both before costfix; do
    case $side in before) tree=$BEFORE ;; costfix) tree=$COSTFIX ;; both) tree=$BOTH ;; esac
    (cd "$tree" && PYTHONPATH="$tree" "$root/.venv/bin/python" -m bench --reps 2 --ks 4 --ngram-ks 32 --no-model-draft \
      --long-match 0 --only '^(target-only|ngram adaptive<=32)$' \
      --out "$here/runs3/${side}_$run" > "/tmp/matchab3_${side}_$run.log" 2>&1)
  done
done
