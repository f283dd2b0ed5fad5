"""Tests for tandem/sessions.py: the session store (ids, KV sequence pool, idleness) and per-session bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest

from tandem.errors import InvalidArgument, PositionMismatch, ResourceExhausted, SessionNotFound
from tandem.sampling import SamplingParams
from tandem.sessions import Session, SessionStore, make_rng

GREEDY = SamplingParams(temperature=0)


def create(store: SessionStore, session_id: str, prompt: Sequence[int] = (1, 2, 3)) -> Session:
    return store.create(session_id, prompt, GREEDY, np.random.default_rng(0), -1)


def make_session(tokens: Sequence[int] = (1, 2, 3)) -> Session:
    return Session(
        session_id="s",
        seq_id=0,
        prompt=tuple(tokens),
        sampling=GREEDY,
        rng=np.random.default_rng(0),
        tokens=list(tokens),
    )


# --- SessionStore -----------------------------------------------------------------------------------------------


def test_create_then_get() -> None:
    store = SessionStore(max_sessions=2, idle_timeout_s=10.0)
    prompt = [5, 6, 7]
    session = store.create("a", prompt, GREEDY, np.random.default_rng(0), 3)
    assert len(store) == 1
    assert store.get("a") is session
    assert store.find("a") is session
    assert session.prompt == (5, 6, 7)
    assert session.tokens == [5, 6, 7]
    assert session.position == 3
    assert session.top_logprobs == 3
    assert session.kv_tokens == []
    assert session.last_call is None
    # The session's tokens are a copy: later edits do not touch the caller's list or the recorded prompt.
    session.tokens.append(8)
    assert prompt == [5, 6, 7]
    assert session.prompt == (5, 6, 7)


def test_seq_ids_are_distinct_and_start_at_zero() -> None:
    store = SessionStore(max_sessions=3, idle_timeout_s=10.0)
    seq_ids = [create(store, sid).seq_id for sid in ("a", "b", "c")]
    assert seq_ids == [0, 1, 2]


def test_pool_exhaustion() -> None:
    store = SessionStore(max_sessions=2, idle_timeout_s=10.0)
    create(store, "a")
    create(store, "b")
    with pytest.raises(ResourceExhausted):
        create(store, "c")
    assert len(store) == 2
    assert store.find("c") is None


def test_zero_capacity_store_refuses_everything() -> None:
    store = SessionStore(max_sessions=0, idle_timeout_s=10.0)
    with pytest.raises(ResourceExhausted):
        create(store, "a")


def test_seq_id_reused_after_close() -> None:
    store = SessionStore(max_sessions=2, idle_timeout_s=10.0)
    create(store, "a")
    b = create(store, "b")
    closed = store.close("b")
    assert closed is b and b.closed
    assert len(store) == 1
    with pytest.raises(ResourceExhausted):  # not reusable until the engine thread has reclaimed it
        create(store, "c")
    reclaim(store)
    c = create(store, "c")
    assert c.seq_id == b.seq_id
    with pytest.raises(ResourceExhausted):
        create(store, "d")


def reclaim(store: SessionStore, keep_cache: bool = False) -> None:
    for session in store.take_closed():
        store.release(session, keep_cache)


def test_prefix_cache_picks_the_longest_shared_prefix_then_lru() -> None:
    store = SessionStore(max_sessions=3, idle_timeout_s=10.0)
    a = create(store, "a", [1, 2, 3])
    a.kv_tokens = [1, 2, 3, 4, 5]
    b = create(store, "b", [7, 8])
    b.kv_tokens = [7, 8, 9]
    store.close("a")
    store.close("b")
    reclaim(store, keep_cache=True)
    assert store.cached_tokens == 8
    turn2 = create(store, "c", [1, 2, 3, 4, 6, 6])
    assert turn2.seq_id == a.seq_id and turn2.kv_tokens == [1, 2, 3, 4]
    assert store.reused_tokens == 4
    # No shared prefix: the least recently released slot is taken and nothing is reused.
    other = create(store, "d", [5])
    assert other.kv_tokens == []
    assert other.seq_id != b.seq_id  # the never-used slot went free first, before b was released
    last = create(store, "e", [9])
    assert last.seq_id == b.seq_id and last.kv_tokens == []


def test_session_id_reusable_after_close() -> None:
    store = SessionStore(max_sessions=1, idle_timeout_s=10.0)
    create(store, "a", [1])
    store.close("a")
    reclaim(store)
    again = create(store, "a", [2])
    assert again.prompt == (2,)
    assert store.get("a") is again


def test_close_unknown_returns_none_and_frees_nothing() -> None:
    store = SessionStore(max_sessions=1, idle_timeout_s=10.0)
    create(store, "a")
    assert store.close("nope") is None
    assert store.close("a") is not None
    assert store.close("a") is None  # closing twice must not put the seq id back twice
    reclaim(store)
    create(store, "b")
    with pytest.raises(ResourceExhausted):
        create(store, "c")


def test_unknown_id() -> None:
    store = SessionStore(max_sessions=1, idle_timeout_s=10.0)
    assert store.find("x") is None
    with pytest.raises(SessionNotFound):
        store.get("x")
    create(store, "x")
    store.close("x")
    with pytest.raises(SessionNotFound):
        store.get("x")


def test_duplicate_id_is_invalid_and_keeps_the_original() -> None:
    store = SessionStore(max_sessions=3, idle_timeout_s=10.0)
    original = create(store, "a", [1, 2])
    with pytest.raises(InvalidArgument):
        create(store, "a", [1, 2])
    with pytest.raises(InvalidArgument):
        create(store, "a", [9])
    assert store.get("a") is original
    assert len(store) == 1
    # The failed attempts did not consume seq ids.
    assert [create(store, sid).seq_id for sid in ("b", "c")] == [1, 2]


@pytest.mark.parametrize(("session_id", "prompt"), [("a", []), ("a", ()), ("", [1])])
def test_empty_prompt_or_id_is_invalid(session_id: str, prompt: Sequence[int]) -> None:
    store = SessionStore(max_sessions=1, idle_timeout_s=10.0)
    with pytest.raises(InvalidArgument):
        create(store, session_id, prompt)
    assert len(store) == 0
    create(store, "ok")  # the slot was not consumed


def test_idle_uses_strictly_greater_than_timeout() -> None:
    store = SessionStore(max_sessions=3, idle_timeout_s=10.0)
    old = create(store, "old")
    new = create(store, "new")
    old.last_used = 100.0
    new.last_used = 105.0
    assert store.idle(now=109.0) == []
    assert store.idle(now=110.0) == []  # exactly the timeout: not yet idle
    assert store.idle(now=110.5) == ["old"]
    assert sorted(store.idle(now=200.0)) == ["new", "old"]


def test_get_refreshes_last_used() -> None:
    store = SessionStore(max_sessions=1, idle_timeout_s=10.0)
    session = create(store, "a")
    session.last_used = time.monotonic() - 1000.0
    assert store.idle() == ["a"]
    store.get("a")
    assert store.idle() == []
    assert store.idle(now=session.last_used + 10.5) == ["a"]


def test_find_does_not_refresh_last_used() -> None:
    store = SessionStore(max_sessions=1, idle_timeout_s=10.0)
    session = create(store, "a")
    session.last_used = 0.0
    store.find("a")
    assert session.last_used == 0.0


# --- Session ------------------------------------------------------------------------------------------------------


def test_expect_position_matching_and_mismatching() -> None:
    session = make_session([1, 2, 3])
    assert session.expect_position(3, ("verify", 3)) is None
    with pytest.raises(PositionMismatch):
        session.expect_position(2, ("verify", 2))
    with pytest.raises(PositionMismatch):
        session.expect_position(4, ("verify", 4))


def test_expect_position_exact_retry_returns_cached_answer() -> None:
    session = make_session([1, 2, 3])
    key = ("verify", 3, (4, 5))
    answer = {"accepted": 2}
    session.last_call = (key, answer)
    session.tokens.extend([4, 5])  # the call was applied: the session moved on
    # The retry still carries the old position, and is answered from memory rather than rejected.
    assert session.expect_position(3, key) is answer
    # A different call at the old position is a real mismatch.
    with pytest.raises(PositionMismatch):
        session.expect_position(3, ("verify", 3, (4, 6)))
    # A new call at the current position is fresh.
    assert session.expect_position(5, ("verify", 5, (6,))) is None


@pytest.mark.parametrize(
    ("kv_tokens", "tokens", "kept", "kv_after"),
    [
        ([], [1, 2], 0, []),
        ([1, 2, 3], [], 0, []),
        ([1, 2, 3, 4], [1, 2, 9], 2, [1, 2]),
        ([1, 2], [1, 2, 3], 2, [1, 2]),
        ([1, 2, 3], [1, 2], 2, [1, 2]),
        ([1, 2, 3], [1, 2, 3], 3, [1, 2, 3]),
        ([7, 2, 3], [1, 2, 3], 0, []),  # common tokens after a difference do not count
    ],
)
def test_kv_catch_up_keeps_longest_common_prefix(
    kv_tokens: list[int], tokens: list[int], kept: int, kv_after: list[int]
) -> None:
    session = make_session([1])
    session.kv_tokens = list(kv_tokens)
    tokens_before = list(tokens)
    assert session.kv_catch_up(tokens) == kept
    assert session.kv_tokens == kv_after
    assert tokens == tokens_before  # the argument is not modified


def test_kv_catch_up_accepts_its_own_tokens_slice() -> None:
    session = make_session([1, 2, 3, 4])
    session.kv_tokens = [1, 2, 3, 4, 5]
    assert session.kv_catch_up(session.tokens[:-1]) == 3
    assert session.kv_tokens == [1, 2, 3]


# --- make_rng ---------------------------------------------------------------------------------------------------


def test_make_rng_seeded_is_reproducible_and_salted() -> None:
    a = make_rng(42).integers(0, 2**32, size=4)
    b = make_rng(42).integers(0, 2**32, size=4)
    salted = make_rng(42, salt=1).integers(0, 2**32, size=4)
    other_seed = make_rng(43).integers(0, 2**32, size=4)
    assert a.tolist() == b.tolist()
    assert a.tolist() != salted.tolist()
    assert a.tolist() != other_seed.tolist()
    assert isinstance(make_rng(None), np.random.Generator)


def test_common_prefix_agrees_with_the_definition() -> None:
    """The slice-and-bisect version against a plain loop, on random pairs that share prefixes of every length
    (equal, one a prefix of the other, a mismatch anywhere), lists and tuples mixed."""
    import random

    from tandem.sessions import common_prefix

    def naive(a, b) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    rng = random.Random(7)
    for _ in range(2000):
        shared = [rng.randrange(5) for _ in range(rng.randrange(0, 300))]
        a = shared + [rng.randrange(5) for _ in range(rng.randrange(0, 20))]
        b = shared + [rng.randrange(5) for _ in range(rng.randrange(0, 20))]
        for x, y in ((a, b), (tuple(a), b), (a, tuple(b)), (b, a)):
            assert common_prefix(x, y) == naive(x, y)
