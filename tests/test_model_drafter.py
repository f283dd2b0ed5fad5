"""The model drafter on the real embedded model: how its KV takes in the tokens of a finished round."""

from __future__ import annotations

import tandem.engine as engine_module  # isort: skip  (llama_cpp first)
import pytest

from services.draft.drafters import ModelDrafter
from tandem.config import EngineSettings
from tandem.engine import Engine
from tandem.sampling import SamplingParams
from tandem.sessions import Session, make_rng


@pytest.fixture(scope="module")
def engine() -> Engine:
    assert engine_module.Engine is Engine
    eng = Engine(EngineSettings(n_threads=1, max_sessions=2, n_ctx=2048))
    yield eng
    eng.close()


class CountingEngine:
    """The real engine, counting its llama_decode passes and the tokens each carries."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.passes: list[int] = []

    def decode(self, items, copy: bool = True):
        self.passes.append(sum(len(item.tokens) for item in items))
        return self._engine.decode(items, copy=copy)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def _round_fully_accepted(engine: Engine) -> tuple[list[int], list[int], list[int]]:
    """Open a session, draft 3 tokens, commit them all plus one token of the target's own, then draft again.

    Returns the passes (tokens each) of the second proposal, its draft, and the first draft.
    """
    counting = CountingEngine(engine)
    drafter = ModelDrafter(counting)  # type: ignore[arg-type]
    prompt = engine.tokenize("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")
    session = Session("s", 0, tuple(prompt), SamplingParams(temperature=0.0), make_rng(0), tokens=list(prompt))
    engine.clear(0)
    drafter.open([session])
    first = drafter.propose(session, 3).tokens
    assert len(first) == 3
    bonus = engine.tokenize(" x", add_special=False)[0]
    session.tokens.extend([*first, bonus])  # the target accepted the whole draft and added its own token
    counting.passes.clear()
    second = drafter.propose(session, 3).tokens
    drafter.close(session)
    return counting.passes, second, first


def test_the_catch_up_after_a_fully_accepted_round_is_stepwise(engine: Engine) -> None:
    """After a fully accepted round the draft lacks two tokens (its last draft token, the target's bonus): it takes
    them one a pass (one-token numerics, and on CUDA the cheap pass: docs/decisions/0007), then drafts on."""
    passes, draft, first = _round_fully_accepted(engine)
    assert len(first) == 3 and len(draft) == 3
    # Catch-up one token a pass, then a pass per further draft token (the last draft token is never decoded).
    assert passes == [1, 1, 1, 1]
