"""The benchmark's statistics: per-prompt medians over repetitions, geometric means over prompts (exact checks)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.harness import Config, Record, resummarise, summarise
from bench.workloads import workloads

EDIT = next(w for w in workloads(False) if w.name == "edit")
CONFIGS = [
    Config("target-only", "tandem", "", 0, "target-only"),
    Config("ngram k=8", "tandem", "", 8, "target-only", "ngram"),
]


def rec(config: str, prompt: int, rep: int, tok_s: float) -> Record:
    timings = {"predicted_per_second": tok_s, "predicted_n": 100, "predicted_ms": 100_000 / tok_s}
    return Record(config, "edit", prompt, rep, "text", timings, 1.0)


def records() -> list[Record]:
    # Prompt 0 decodes at ~150 tok/s with speculation, prompt 1 at ~60; one repetition of prompt 0 was disturbed.
    out = [rec("target-only", p, r, v) for p, r, v in [(0, 0, 50), (0, 1, 52), (0, 2, 48), (1, 0, 55), (1, 1, 55),
                                                       (1, 2, 56)]]  # fmt: skip
    out += [rec("ngram k=8", p, r, v) for p, r, v in [(0, 0, 150), (0, 1, 90), (0, 2, 152), (1, 0, 60), (1, 1, 61),
                                                      (1, 2, 59)]]  # fmt: skip
    return out


def test_rates_are_geometric_means_of_per_prompt_medians() -> None:
    rows = {r["config"]: r for r in summarise(CONFIGS, [EDIT], records())}
    assert rows["target-only"]["tok_s"] == pytest.approx((50 * 55) ** 0.5)
    assert rows["ngram k=8"]["tok_s"] == pytest.approx((150 * 60) ** 0.5)  # the disturbed 90 is not the median
    assert rows["ngram k=8"]["speedup"] == pytest.approx((150 / 50 * 60 / 55) ** 0.5)
    assert rows["target-only"]["speedup"] == pytest.approx(1.0)


def test_resummarise_rewrites_the_tables_from_the_records(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    old_rows = [{"config": c.name, "family": c.family, "drafter": c.drafter, "workload": "edit", "speedup": 9.9}
                for c in CONFIGS]  # fmt: skip
    meta = {"command": "python -m bench", "date": "then", "label": "", "reps": 3, "max_tokens": 256, "seconds": 1}
    path.write_text(json.dumps({"meta": meta, "rows": old_rows, "records": [asdict(r) for r in records()]}))
    assert resummarise(path) == 0
    data = json.loads(path.read_text())
    speedup = {r["config"]: r["speedup"] for r in data["rows"]}
    assert speedup["ngram k=8"] == pytest.approx((150 / 50 * 60 / 55) ** 0.5)
    assert "resummarised" in data["meta"]
    assert "ngram k=8" in (tmp_path / "table.md").read_text()


def test_only_keeps_matching_configurations_and_their_baselines() -> None:
    from bench.harness import select_configs

    configs = [
        *CONFIGS,
        Config("co-located target-only", "tandem", "", 0, "co-located target-only"),
        Config("co-located ngram k=8", "tandem", "", 8, "co-located target-only", "ngram"),
        Config("llama-server", "llama-server", "", None, "llama-server"),
    ]
    names = [c.name for c in select_configs(configs, "ngram k=8$")]
    assert names == ["target-only", "ngram k=8", "co-located target-only", "co-located ngram k=8"]
    assert [c.name for c in select_configs(configs, "^llama-server$")] == ["llama-server"]
    with pytest.raises(SystemExit, match="matches no configuration"):
        select_configs(configs, "nothing")


def test_sampled_repetitions_draw_new_texts_with_the_same_seed_on_every_side() -> None:
    """A sampled workload's seed moves on with the repetition, alike for tandem and llama-server; a greedy workload
    sends none."""
    from bench.harness import request_body
    from bench.workloads import Workload

    sampled, greedy = Workload("chat-t0.7", ("hi",), 0.7, 1234), Workload("chat", ("hi",))
    tandem, peer = CONFIGS[0], Config("llama-server", "llama-server", "", None, "llama-server")
    seeds = [[request_body(c, sampled, "hi", 16, rep)["seed"] for rep in range(3)] for c in (tandem, peer)]
    assert seeds == [[1234, 1235, 1236]] * 2
    assert "seed" not in request_body(tandem, greedy, "hi", 16, 2)
