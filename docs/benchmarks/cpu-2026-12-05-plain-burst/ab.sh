# Target-only decoding with the gateway's default plain burst (40 ms of tokens a Verify call) against 100 ms
# (TANDEM_GATEWAY_PLAIN_BURST_MS, read by every gateway the harness starts), llama-server's plain decoding beside
# each: two runs of each, alternating. Writes <burst>_<run>/ next to this script.
set -u
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
for run in 1 2; do
  for burst in 40 100; do
    TANDEM_GATEWAY_PLAIN_BURST_MS=$burst LLAMA_SERVER=/tmp/peer/build/bin/llama-server .venv/bin/python -m bench \
      --reps 3 --ks 8 --no-model-draft --no-adaptive --long-match 0 --colocated --workloads chat,edit,json \
      --only '^(target-only|co-located target-only|llama-server)$' \
      --out "$here/${burst}_$run" > "/tmp/burst_${burst}_$run.log" 2>&1
  done
done
