"""`make load`: start target, n-gram draft and gateway on loopback, run bench.load (32 clients, 60 s), stop them."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench.load import main as load_main
from tandem.launch import start_gateway, start_model_service


def main() -> int:
    logs = Path(tempfile.mkdtemp(prefix="tandem-load-"))
    target = start_model_service("services.target", ["--max-sessions", "8"], logs)
    draft = start_model_service("services.draft", ["--drafter", "ngram", "--max-sessions", "8"], logs)
    gateway = start_gateway(target.address, draft.address, logs)
    try:
        pids = ",".join(str(p.pid) for p in (gateway, target, draft))
        return load_main(
            ["--url", gateway.address, "--clients", "32", "--seconds", "60", "--pids", pids, *sys.argv[1:]]
        )
    finally:
        for p in (gateway, draft, target):
            p.stop()


if __name__ == "__main__":
    sys.exit(main())
