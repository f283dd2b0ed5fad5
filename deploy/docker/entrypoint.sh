#!/bin/sh
# Entry point of the model images: runs the target or the draft service (TANDEM_SERVICE), passing any arguments on;
# `gateway` runs the gateway with the target in its process (--colocate-target: compose's mixed profile).
#
#   docker run tandem-model:cpu --n-ctx 8192                    # the target (default)
#   docker run -e TANDEM_SERVICE=draft tandem-model:cpu --drafter ngram
#
# Compose passes model paths as TANDEM_TARGET_MODEL=${TARGET_MODEL:-}: an empty value means "not set" (the service's
# default, the embedded model), so empty *_MODEL variables are dropped here: the services would read "" as a path.
set -eu

service="${TANDEM_SERVICE:-target}"
case "$service" in
    target|draft|gateway) ;;
    *) echo "entrypoint: TANDEM_SERVICE must be target, draft or gateway, not '$service'" >&2; exit 64 ;;
esac

for var in TANDEM_TARGET_MODEL TANDEM_DRAFT_MODEL; do
    eval "value=\${$var-}"
    if [ -z "$value" ]; then
        unset "$var"
    fi
done

exec "tandem-$service" "$@"
