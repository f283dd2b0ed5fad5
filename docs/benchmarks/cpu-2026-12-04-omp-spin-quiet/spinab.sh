cd /work/main
for run in 1 2; do
  for spin in default 10000; do
    if [ $spin = default ]; then unset GOMP_SPINCOUNT; else export GOMP_SPINCOUNT=$spin; fi
    .venv/bin/python -m bench --reps 2 --ks 8 --no-model-draft --no-adaptive --long-match 0 \
      --workloads json,chat,edit-t0.7,summary --only '^(target-only|ngram-service k=8|ngram k=8)$' --out /tmp/spin/${spin}_$run > /tmp/spin/${spin}_$run.log 2>&1
  done
done
echo done > /tmp/spin/DONE
