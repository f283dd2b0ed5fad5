# Sampled model-drafter rounds before (0f3b15a, checked out at /tmp/old) and after (4de6d97, at /tmp/new) the cheaper
# draft distribution: two runs of each, alternating. Writes <side>_<run>/ next to this script.
set -u
here=$(cd "$(dirname "$0")" && pwd)
for run in 1 2; do
  for side in old new; do
    (cd "/tmp/$side" && PYTHONPATH="/tmp/$side" /work/main/.venv/bin/python -m bench --reps 2 --ks 4,8 --no-adaptive \
      --workloads edit-t0.7,chat-t0.7 --only '^(target-only|model k=4|model k=8)$' \
      --out "$here/${side}_$run" > "/tmp/ab_${side}_$run.log" 2>&1)
  done
done
