#!/usr/bin/env python3
"""Exit 0 iff a tandem model service answers SERVING on grpc.health.v1; exit 1 otherwise (not listening, loading,
shutting down, wrong service).

Used by the model images' HEALTHCHECK and by compose.yaml; Kubernetes uses its native gRPC probes instead.
Without arguments it checks the service this container runs: TANDEM_SERVICE (target or draft, as the image's
entrypoint uses it) picks the port (TANDEM_TARGET_PORT / TANDEM_DRAFT_PORT, else 50051 / 50052) and the service name
(tandem.v1.Target / tandem.v1.Draft), on 127.0.0.1: a health check runs inside the container's own network namespace.

    grpc_health_check.py                                   # the container's own service
    grpc_health_check.py --address 127.0.0.1:50052 --service tandem.v1.Draft
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULTS = {
    "target": ("TANDEM_TARGET_PORT", 50051, "tandem.v1.Target"),
    "draft": ("TANDEM_DRAFT_PORT", 50052, "tandem.v1.Draft"),
}


def default_target(environ: dict[str, str]) -> tuple[str, str]:
    """(address, service name) of the service named by TANDEM_SERVICE, from the same variables the service reads."""
    kind = environ.get("TANDEM_SERVICE", "target")
    if kind not in DEFAULTS:
        raise SystemExit(f"grpc_health_check: TANDEM_SERVICE must be target or draft, not {kind!r}")
    port_var, port, name = DEFAULTS[kind]
    address = environ.get("TANDEM_HEALTH_ADDRESS") or f"127.0.0.1:{environ.get(port_var) or port}"
    return address, name


def check(address: str, service: str, timeout: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # A proxy from the environment must never see a loopback health check.
    options = [("grpc.enable_http_proxy", 0)]
    try:
        with grpc.insecure_channel(address, options=options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        return False, f"{exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    address, service = default_target(dict(os.environ))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default=address, help=f"host:port (default: {address})")
    parser.add_argument("--service", default=service, help=f"grpc.health.v1 service name (default: {service})")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default: 3)")
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    args = parser.parse_args(argv)
    ok, status = check(args.address, args.service, args.timeout)
    if not args.quiet:
        print(f"{args.address} {args.service or '(server)'}: {status}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
