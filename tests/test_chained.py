"""Chained drafting (`--drafter ngram,model`): prompt lookup first, the draft model where lookup finds nothing.

On the real embedded model: the drafter's choice per proposal (a lookup proposal has a match length and no
distributions even for a sampled request; a model proposal has distributions), a request narrowing the chain
(`speculative.type`), and end to end through the real gateway: greedy text equal to target-only decoding, and clear
400s for a type the deployment does not offer.
"""

from __future__ import annotations

import tandem.engine as engine_module  # isort: skip  (llama_cpp first)
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import THREADS, Service, start_gateway, start_model_service

from services.draft.chained import ChainedDrafter
from tandem.config import EngineSettings
from tandem.engine import Engine
from tandem.errors import InvalidArgument
from tandem.sampling import SamplingParams
from tandem.sessions import Session, make_rng

REPEAT = "The quick brown fox jumps over the lazy dog near the river bank. " * 2 + "The quick brown fox"
PLAIN = "Write one sentence about the weather in spring."


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    assert engine_module.Engine is Engine
    eng = Engine(EngineSettings(n_threads=1, max_sessions=2, n_ctx=2048))
    yield eng
    eng.close()


def _session(engine: Engine, text: str, params: SamplingParams, types: tuple[str, ...] = ()) -> Session:
    prompt = engine.tokenize(text)
    session = Session("s", 0, tuple(prompt), params, make_rng(7), tokens=list(prompt))
    session.draft_types = types
    engine.clear(0)
    return session


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_lookup_drafts_where_the_text_repeats_and_the_model_elsewhere(engine: Engine, temperature: float) -> None:
    drafter = ChainedDrafter(engine)
    params = SamplingParams(temperature=temperature, seed=3)
    repeat = _session(engine, REPEAT, params)
    drafter.open([repeat])
    looked_up = drafter.propose(repeat, 4)
    drafter.close(repeat)
    expected = engine.tokenize(" jumps over the lazy dog", add_special=False)
    assert looked_up.match_len > 0 and looked_up.dists is None  # a fixed proposal, sampled request or not
    assert looked_up.tokens == expected[: len(looked_up.tokens)] and len(looked_up.tokens) >= 2

    plain = _session(engine, PLAIN, params)
    drafter.open([plain])
    modelled = drafter.propose(plain, 3)
    drafter.close(plain)
    assert modelled.match_len == 0 and 1 <= len(modelled.tokens) <= 3  # sampled, it may end at an end-of-turn token
    if temperature == 0.0:
        assert modelled.dists is None and len(modelled.tokens) == 3
    else:  # the model's q goes with each sampled token
        assert modelled.dists is not None and len(modelled.dists) == len(modelled.tokens)


def test_a_session_narrowed_to_one_type_drafts_only_with_it(engine: Engine) -> None:
    drafter = ChainedDrafter(engine)
    greedy = SamplingParams(temperature=0.0)
    model_only = _session(engine, REPEAT, greedy, ("model",))
    drafter.open([model_only])
    by_model = drafter.propose(model_only, 4)
    drafter.close(model_only)
    assert by_model.match_len == 0 and len(by_model.tokens) == 4  # the repeat is there, but lookup is off

    lookup_only = _session(engine, PLAIN, greedy, ("ngram",))
    drafter.open([lookup_only])
    assert drafter.propose(lookup_only, 4).tokens == []  # nothing to look up, and no model to fall back on
    drafter.close(lookup_only)


def test_the_lookup_follows_committed_tokens_and_rollbacks(engine: Engine) -> None:
    drafter = ChainedDrafter(engine)
    session = _session(engine, PLAIN + " Rain falls. Rain", SamplingParams(temperature=0.0))
    drafter.open([session])
    assert drafter.propose(session, 4).match_len > 0  # " Rain" repeats: lookup proposes " falls."
    start = len(session.tokens)
    session.tokens.extend(engine.tokenize(" soaks the garden", add_special=False))
    drafter.appended(session, start)
    assert drafter.propose(session, 3).match_len == 0  # new text, no repeat: the model drafts
    del session.tokens[start:]
    drafter.truncated(session)
    assert drafter.propose(session, 4).match_len > 0  # rolled back to the repeat: lookup again
    drafter.close(session)


@pytest.fixture(scope="module")
def chained_gateway(service_tmp: Path) -> Iterator[Service]:
    """Sequential verification without prefix reuse: greedy output is then bit-identical to target-only decoding
    (batched verification may flip near-ties: tests/test_lossless_e2e.py)."""
    exact = ["--n-threads", THREADS, "--max-sessions", "4", "--n-ctx", "8192", "--no-prefix-cache"]
    target = start_model_service("services.target", ["--verify-mode", "sequential", *exact], service_tmp)
    draft = start_model_service("services.draft", ["--drafter", "ngram,model", *exact], service_tmp)
    gateway = start_gateway(target.address, draft.address, service_tmp)
    yield gateway
    for process in (gateway, draft, target):
        process.stop()


def _complete(url: str, prompt: str, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "timings_detail": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


@pytest.mark.parametrize("types", [None, "ngram", "model", "ngram,model"])
def test_chained_greedy_text_is_the_targets(chained_gateway: Service, types: str | None) -> None:
    prompt = "def area(r):\n    return 3.14 * r * r\n\ndef perimeter(r):\n    return"
    plain = _complete(chained_gateway.address, prompt, **{"speculative.n_max": 0})
    # Fixed k: a same-size draft on this CPU cannot pay, so adaptive k would stop drafting after a probe.
    extra = {"speculative.n_max": 4, "speculative.adaptive": False, **({"speculative.type": types} if types else {})}
    reply = _complete(chained_gateway.address, prompt, **extra)
    assert plain.status_code == reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    timings = reply.json()["timings"]
    assert timings["speculation"] == "on" and timings["draft_n"] > 0


def test_a_type_the_deployment_does_not_offer_is_a_400(chained_gateway: Service, gateway: Service) -> None:
    bogus = _complete(chained_gateway.address, "Hi", **{"speculative.type": "eagle"})
    assert bogus.status_code == 400
    assert bogus.json()["error"]["param"] == "speculative.type" and "ngram, model" in bogus.json()["error"]["message"]
    no_model = _complete(gateway.address, "Hi", **{"speculative.type": "model"})  # the n-gram draft service
    assert no_model.status_code == 400 and "ngram" in no_model.json()["error"]["message"]


def test_the_draft_service_refuses_a_type_it_does_not_offer(engine: Engine) -> None:
    from services.draft.service import DraftService

    service = DraftService(ChainedDrafter(engine), 2, 60.0, engine.n_vocab, 2048)
    prompt = engine.tokenize(PLAIN)
    with pytest.raises(InvalidArgument, match="not offered"):
        service.open([("s", prompt, SamplingParams(temperature=0.0), None, None, ("eagle",))])
