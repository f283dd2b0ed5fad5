# The same with a MatchHistory tree as "after": more samples of the sampled workloads (and greedy chat), four
# repetitions (four seeds), two runs of each side. Writes before4_<run>/ and after4_<run>/ here.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
for run in 1 2; do
  for side in after before; do
    if [ $side = before ]; then tree=$BEFORE; else tree=$root; fi
    (cd "$tree" && PYTHONPATH="$tree" "$root/.venv/bin/python" -m bench --reps 4 --ks 4 --ngram-ks 32 --no-model-draft \
      --long-match 0 --workloads chat-t0.7,edit-t0.7,chat --only '^(target-only|ngram adaptive<=32)$' \
      --out "$here/${side}4_$run" > "/tmp/matchab_${side}4_$run.log" 2>&1)
  done
done
