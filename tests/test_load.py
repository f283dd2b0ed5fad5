"""A short load test in CI (the full 32 clients x 60 s runs with `make load`): concurrent streaming clients, no
unexpected errors, every temperature-0 answer identical to its single-request answer, bounded memory."""

from __future__ import annotations

import asyncio

from bench.load import run
from tests.conftest import Service


def test_concurrent_streams_are_correct_and_bounded(gateway: Service, target: Service, ngram_draft: Service) -> None:
    pids = [gateway.pid, target.pid, ngram_draft.pid]
    report = asyncio.run(run(gateway.address, clients=16, seconds=15, pids=pids))
    print(report)
    assert report["requests"] >= 16
    assert report["unexpected_errors"] == 0, report["first_errors"]
    assert report["mismatches"] == 0
    for pid, rss in report["rss_mib"].items():
        assert rss["end"] is not None and rss["end"] < rss["start"] + 200, (pid, rss)
