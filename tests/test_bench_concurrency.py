"""The concurrency benchmark's arithmetic: tokens inside a measuring window, and the spread it reports."""

from __future__ import annotations

import json

import pytest

from bench.concurrency import cell_plan, over_sample, read_metrics, tokens_in_window, write


def test_a_request_counts_with_the_share_of_its_time_inside_the_window() -> None:
    requests = [
        (0.0, 2.0, 100),  # wholly inside
        (1.0, 5.0, 40),  # half inside (1..3 of 1..5)
        (-1.0, 1.0, 10),  # started before the window: half inside
        (3.0, 4.0, 99),  # after the window
        (-2.0, -1.0, 99),  # before it
    ]
    assert tokens_in_window(requests, 0.0, 3.0) == pytest.approx(100 + 20 + 5)


def test_a_window_inside_one_long_request_takes_its_rate() -> None:
    assert tokens_in_window([(0.0, 10.0, 500)], 2.0, 4.0) / 2.0 == pytest.approx(50.0)


def test_the_table_gives_each_cell_the_range_of_its_repetitions(tmp_path) -> None:
    samples = [{"mode": "on", "tok_s": 10.0}, {"mode": "off", "tok_s": 8.0}]
    rows = [
        {
            "workload": "chat",
            "concurrency": 1,
            "off_tok_s": 10.0,
            "on_tok_s": 11.0,
            "ratio": 1.1,
            "samples": samples,
            "ratio_lo": 0.92,
            "ratio_hi": 1.25,
        },
        {"workload": "chat", "concurrency": 2, "off_tok_s": 10.0, "on_tok_s": 9.0, "ratio": 0.9, "samples": samples},
        {
            "workload": "chat",
            "concurrency": 4,
            "off_tok_s": 10.0,
            "on_tok_s": 11.6,
            "ratio": 1.162,
            "samples": samples,
            "ratio_lo": 1.161,
            "ratio_hi": 1.164,
        },
    ]
    write(tmp_path, {"date": "today", "command": "python -m bench", "seconds": 1.0}, rows)
    table = (tmp_path / "concurrency.md").read_text()
    assert "(**1.10**, 0.92-1.25)" in table
    assert "(**0.90**)" in table  # no range recorded (one repetition, or an older run's rows)
    assert "(**1.16**)" in table  # a range that rounds to one value is not shown
    assert json.loads((tmp_path / "concurrency.json").read_text())["rows"][0]["ratio_lo"] == 0.92


def test_a_run_stopped_by_a_failed_sample_says_so_above_its_cells(tmp_path) -> None:
    samples = [{"mode": "on", "tok_s": 10.0}, {"mode": "off", "tok_s": 8.0}]
    rows = [
        {"workload": "edit", "concurrency": 1, "off_tok_s": 8.0, "on_tok_s": 10.0, "ratio": 1.25, "samples": samples}
    ]
    meta = {"date": "today", "command": "python -m bench", "seconds": 1.0, "failure": "HTTPStatusError: 503"}
    write(tmp_path, meta, rows)
    table = (tmp_path / "concurrency.md").read_text()
    assert "**Stopped early** by a failed sample (HTTPStatusError: 503)" in table
    assert "(**1.25**)" in table


def test_a_sample_reads_the_governors_epochs_from_the_gateways_metrics() -> None:
    """Real metrics as the gateway renders them: epochs summed over load levels, by whether drafts were sent."""
    from services.gateway.metrics import GatewayMetrics, observe_epoch

    metrics = GatewayMetrics()
    observe_epoch(metrics, "2", True, 500.0)
    observe_epoch(metrics, "9-16", True, 900.0)
    observe_epoch(metrics, "9-16", False, 950.0)
    metrics.num_draft_tokens.inc(7)
    read = read_metrics(metrics.render().decode())
    assert read["epochs_drafted"] == 2.0
    assert read["epochs_plain"] == 1.0
    assert read["drafted"] == 7.0


def test_a_sample_keeps_the_prices_at_its_end_and_counts_the_rest_over_it() -> None:
    """The gateway's prices of rounds are gauges: a sample records them as they stood when it ended (in ms), where its
    counters are differences. Read from metrics as the gateway renders them, for a cost model that measured steps."""
    from services.gateway.costs import CostModel
    from services.gateway.metrics import GatewayMetrics

    unmeasured = read_metrics(GatewayMetrics().render().decode())
    assert "price_plain_ms" not in unmeasured and "price_round0_ms" not in unmeasured  # NaN until measured
    costs = CostModel()
    for tokens, ns in ((1, 2_000_000), (5, 3_000_000), (2, 2_250_000), (3, 2_500_000)) * 4:
        costs.observe_verify(tokens, 1, ns)
    costs.observe_plain_step(2_000_000)
    costs.observe_overhead(500_000)
    metrics = GatewayMetrics()
    metrics.observe_prices(costs, max_draft=4)
    metrics.num_draft_tokens.inc(7)
    before = {"drafted": 3.0, "price_round0_ms": 9.0}
    read = read_metrics(metrics.render().decode())
    rounds = costs.round_costs(4, priced_alone=True)
    assert rounds is not None
    assert [read[f"price_round{k}_ms"] for k in range(5)] == pytest.approx([ns / 1e6 for ns in rounds])
    assert "price_round5_ms" not in read
    assert read["price_plain_ms"] == pytest.approx(costs.plain_from_round(rounds[0]) / 1e6)
    spent = over_sample(before, read)
    assert spent["drafted"] == 4.0
    assert spent["price_round0_ms"] == round(read["price_round0_ms"], 3)


def test_a_cell_opens_with_an_untimed_window_and_alternates_which_mode_goes_first() -> None:
    """The first window of a cell pays for every stream's prefill at once: it is not recorded, so neither mode's
    first sample carries that (the `off` sample did, and on / off read up to 1.6 where steady windows read 1.0-1.3)."""
    assert cell_plan(2, window_s=3.0) == [("off", False), ("off", True), ("on", True), ("on", True), ("off", True)]
    assert cell_plan(3, window_s=0.0) == [
        ("off", True),
        ("on", True),
        ("on", True),
        ("off", True),
        ("off", True),
        ("on", True),
    ]
