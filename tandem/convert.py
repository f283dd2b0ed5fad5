"""Conversions between the wire messages (tandem.v1) and the core's dataclasses, in one place.

The engine and the sampling math never see protobuf; servicers call these at the edges.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from tandem import PROTOCOL_VERSION
from tandem.cross_vocab import VocabularyText
from tandem.errors import InvalidArgument
from tandem.grammar import Constraint
from tandem.ngram import LookupRule
from tandem.sampling import SamplingParams, SparseDist
from tandem.v1 import tandem_pb2 as pb

if TYPE_CHECKING:
    from tandem.engine import Engine


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    if not np.isfinite(msg.temperature) or msg.temperature < 0:
        raise InvalidArgument(f"temperature must be >= 0, got {msg.temperature}")
    top_p = msg.top_p if msg.top_p > 0 else 1.0
    if not 0 < top_p <= 1:
        raise InvalidArgument(f"top_p must be in (0, 1], got {msg.top_p}")
    return SamplingParams(
        temperature=float(msg.temperature),
        top_k=int(msg.top_k),
        top_p=float(top_p),
        seed=int(msg.seed) if msg.HasField("seed") else None,
    )


def sampling_to_pb(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def constraint_from_pb(msg: pb.OpenItem) -> Constraint | None:
    """The item's constraint, if any (compiled later, by the verifier that owns the tokenizer)."""
    if not msg.HasField("constraint"):
        return None
    kind = msg.constraint.WhichOneof("grammar")
    if kind is None:
        raise InvalidArgument("constraint needs one of json_schema, lark or regex")
    return Constraint(kind, getattr(msg.constraint, kind), tuple(sorted(msg.constraint.lark_grammars.items())))


def constraint_to_pb(constraint: Constraint) -> pb.Constraint:
    return pb.Constraint(**{constraint.kind: constraint.source}, lark_grammars=dict(constraint.named))


def lookup_rule_from_pb(rule: pb.LookupRule) -> LookupRule:
    """The caller's prompt-lookup rule (Continuation.lookup); ValueError if it is inconsistent."""
    return LookupRule(
        ngram_min=rule.ngram_min,
        ngram_max=rule.ngram_max,
        max_draft=rule.max_draft,
        min_draft=rule.min_draft,
        end_position=rule.end_position,
        bucket_rates=tuple(rule.bucket_rates),
        round_costs=tuple(rule.round_costs),
        plain_cost=rule.plain_cost,
    )


def dist_to_pb(dist: SparseDist) -> pb.SparseDistribution:
    return pb.SparseDistribution(token_ids=dist.token_ids.tolist(), probs=dist.probs.tolist())


def dist_from_pb(msg: pb.SparseDistribution, n_vocab: int) -> SparseDist:
    ids = np.asarray(msg.token_ids, dtype=np.int64)
    probs = np.asarray(msg.probs, dtype=np.float64)
    if len(ids) == 0 or len(ids) != len(probs):
        raise InvalidArgument("a draft distribution needs as many probs as token_ids, and at least one")
    ordered = np.sort(ids)  # its ends are the range, its neighbours the duplicates
    if ordered[0] < 0 or ordered[-1] >= n_vocab or np.any(ordered[1:] == ordered[:-1]):
        raise InvalidArgument("draft distribution token ids must be distinct and inside the vocabulary")
    total = float(probs.sum())
    if not math.isfinite(total) or probs.min() < 0 or total <= 0:  # a NaN or an inf anywhere makes the sum one
        raise InvalidArgument("draft distribution probabilities must be finite, non-negative and not all zero")
    # float32 on the wire: renormalise in float64 so q is exactly the distribution the draft sampled from. Checked
    # above, so built without SparseDist's own checks (they would repeat these, ~20 us a draft token).
    return SparseDist.exact(ids, probs / total)


def serving_stats(msg: pb.InfoResponse, store, scheduler, engine: Engine | None = None) -> pb.InfoResponse:
    """Fill an Info answer's live figures: sessions, KV use, batching and prefix-cache counters, the engine's calls."""
    load = msg.load
    load.active_sessions = len(store)
    load.kv_tokens = store.kv_tokens
    load.cached_tokens = store.cached_tokens
    load.reused_prompt_tokens = store.reused_tokens
    if scheduler is not None:
        load.batched_steps = scheduler.steps
        load.batched_calls = scheduler.batched_groups
        load.max_step_calls = scheduler.max_groups_seen
        load.inline_steps = scheduler.inline_steps
    if engine is not None:
        load.decode_calls = engine.decode_calls
        load.decode_ns = engine.forward_ns
        load.reshaped_calls = engine.reshaped_calls
        load.reshaped_ns = engine.reshaped_ns
    return msg


def info_pb(engine: Engine, drafter: str = "", active_sessions: int = 0, kv_tokens: int = 0) -> pb.InfoResponse:
    """Describe a loaded engine (the target, or a draft service's model drafter)."""
    msg = pb.InfoResponse(
        model_name=engine.name,
        architecture=engine.architecture,
        vocab_size=engine.n_vocab,
        vocab_fingerprint=engine.fingerprint,
        context_size=engine.n_ctx,
        backend=engine.backend,
        device=engine.device,
        version=engine.version,
        max_sessions=engine.max_sessions,
        eog_token_ids=engine.eog_ids,
        chat_template=engine.chat_template,
        drafter=drafter,
        bos_text=engine.bos_text,
        eos_text=engine.eos_text,
        load=pb.Load(active_sessions=active_sessions, kv_tokens=kv_tokens),
        protocol_version=PROTOCOL_VERSION,
    )
    if engine.bos_id is not None:
        msg.bos_token_id = engine.bos_id
    return msg


def vocabulary_to_pb(vocabulary: VocabularyText) -> pb.Vocabulary:
    msg = pb.Vocabulary(
        fingerprint=vocabulary.fingerprint,
        pieces=list(vocabulary.pieces),
        markup=vocabulary.markup,
        byte_tokens=sorted(vocabulary.byte_tokens),
    )
    if vocabulary.bos_id is not None:
        msg.bos_token_id = vocabulary.bos_id
    return msg


def vocabulary_from_pb(msg: pb.Vocabulary) -> VocabularyText:
    """A vocabulary from the wire, checked (its ids index its own pieces)."""
    n = len(msg.pieces)
    if not msg.fingerprint or n == 0:
        raise InvalidArgument("a vocabulary needs a fingerprint and its pieces")
    ids = [*msg.markup, *msg.byte_tokens, *([msg.bos_token_id] if msg.HasField("bos_token_id") else [])]
    if any(not 0 <= t < n for t in ids):
        raise InvalidArgument(f"vocabulary token ids must lie in 0..{n - 1}")
    return VocabularyText(
        msg.fingerprint,
        list(msg.pieces),
        dict(msg.markup),
        frozenset(msg.byte_tokens),
        msg.bos_token_id if msg.HasField("bos_token_id") else None,
    )
