# The n-gram draft service with checked rounds against whole rounds (TANDEM_GATEWAY_CHECK_FIRST_DRAFT, read by every
# gateway the harness starts), target-only beside each; two runs of each, alternating. Writes <row>-<mode>_<run>/
# next to this script.
#   bash ab.sh adaptive        the service at adaptive k <= 32 (what `make run` serves): auto against never, its k
#                              chosen by draft position (the code of 06be5c4)
#   bash ab.sh match-policy    the same after ac87b2b: k chosen by the match length behind each proposal
# The fixed-k8-* runs came from the first version, whose auto also gated the rounds of fixed-k requests (now auto
# leaves those whole): `--ks 8 --no-adaptive --only '^(target-only|ngram-service k=8)$'`, auto (-> gated) and never.
set -u
tag=${1:-adaptive}
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
for run in 1 2; do
  for mode in never auto; do
    TANDEM_GATEWAY_CHECK_FIRST_DRAFT=$mode .venv/bin/python -m bench \
      --reps 2 --ks 8 --ngram-ks 32 --no-model-draft --long-match 0 \
      --only '^(target-only|ngram-service adaptive<=32)$' \
      --out "$here/${tag}-${mode}_$run" > "/tmp/check_${mode}_$run.log" 2>&1
  done
done
