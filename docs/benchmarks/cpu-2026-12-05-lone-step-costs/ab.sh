# The adaptive prompt lookup before (a worktree of the parent commit at $BEFORE) and after a shared MatchHistory (the
# working tree of the time; not committed, see README), two runs of each. Writes before_<run>/ and after_<run>/ here.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
for run in 1 2; do
  for side in before after; do
    if [ $side = before ]; then tree=$BEFORE; else tree=$root; fi
    (cd "$tree" && PYTHONPATH="$tree" "$root/.venv/bin/python" -m bench --reps 2 --ks 4 --ngram-ks 32 --no-model-draft \
      --long-match 0 --workloads chat-t0.7,edit-t0.7,chat,edit --only '^(target-only|ngram adaptive<=32)$' \
      --out "$here/${side}_$run" > "/tmp/matchab_${side}_$run.log" 2>&1)
  done
done
