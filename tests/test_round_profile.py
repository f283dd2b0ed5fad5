"""The round profile's arithmetic: per-round layers from probe counters and the replies' timings."""

from __future__ import annotations

from bench.round_profile import split_round


def test_split_round_puts_each_layer_per_round_and_the_rest_between_rounds() -> None:
    before = {"verify.handler": [2, 1_000_000]}
    after = {
        "verify.handler": [12, 181_000_000],  # 10 rounds, 18 ms each inside Verify
        "verify.step": [10, 170_000_000],
        "verify.decode": [10, 160_000_000],
        "verify.forward": [10, 150_000_000],
        "propose.handler": [10, 40_000_000],
        "propose.step": [10, 35_000_000],
        "propose.decode": [20, 30_000_000],
        "propose.forward": [20, 25_000_000],
    }
    replies = [{"timings": {"predicted_ms": 120.0}}, {"timings": {"predicted_ms": 130.0}}]  # 25 ms a round
    row = split_round(before, after, replies, in_rounds_s=0.240)
    assert row["rounds"] == 10
    assert row["round_us"] == 25_000.0
    assert row["verify_forward_us"] == 15_000.0 and row["propose_forward_us"] == 2_500.0
    assert row["propose_decodes"] == 2.0
    assert row["verify_handoff_us"] == 1_000.0  # handler minus step
    assert row["gateway_us"] == 25_000.0 - 4_000.0 - 18_000.0
    assert row["between_rounds_us"] == 1_000.0  # 25 ms a round, 24 ms of it inside the round loop's span
    assert row["overhead_us"] == 7_500.0
    assert row["overhead_pct"] == 30.0
    assert "between_rounds_us" not in split_round(before, after, replies)
