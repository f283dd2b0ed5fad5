# GOMP_SPINCOUNT 10000 (the services' default) against 1000 and 0, two runs of each, interleaved.
# Writes <spin>_<run>/ next to this script; `python summarise.py` prints one line per run.
set -u
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
for run in 1 2; do
  for spin in 10000 1000 0; do
    GOMP_SPINCOUNT=$spin .venv/bin/python -m bench --reps 2 --ks 8 --no-model-draft --no-adaptive --long-match 0 \
      --workloads json,chat,edit-t0.7,summary --only '^(target-only|ngram-service k=8|ngram k=8)$' \
      --out "$here/${spin}_$run" > "/tmp/spinab_${spin}_$run.log" 2>&1
  done
done
