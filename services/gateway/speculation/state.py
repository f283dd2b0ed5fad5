"""What one generation is asked for, how the gateway runs it, and what it reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.grammar import Constraint
from tandem.ngram import NGRAM_MAX, NGRAM_MIN
from tandem.sampling import SamplingParams

PLAIN_PIPELINE = 2  # target-only Verify calls in flight per request (docs/decisions/0008)
PLAIN_BURST_MS = 100.0  # time's worth of target-only tokens one Verify call asks for (docs/decisions/0008)


@dataclass(frozen=True)
class GenerationRequest:
    """One request, as the endpoints translate it."""

    prompt_token_ids: Sequence[int]
    sampling: SamplingParams
    max_tokens: int
    n_max: int  # draft tokens per round (0 = target only)
    n_min: int = 0  # drafts shorter than this are not verified
    top_logprobs: int = -1  # -1 none, 0 chosen token only, n alternatives
    adaptive: bool = True  # choose k per round in [n_min, n_max] from measured costs and acceptance
    overlap: bool | None = None  # the request's own choice of GenerationOptions.overlap (None: the server's)
    ngram_min: int = NGRAM_MIN  # the gateway's own lookup drafts behind suffix matches at least this long
    cross_vocab: str | None = None  # a draft of another vocabulary: "auto", "string" or "intersection" (None: server's)
    draft_types: tuple[str, ...] = ()  # speculative.type: a chained drafter narrowed to these (empty: its whole chain)
    constraint: Constraint | None = None  # what the output must match (the target masks with it)


@dataclass(frozen=True)
class GenerationOptions:
    """The gateway's settings that shape every generation (see tandem.config.GatewaySettings)."""

    rpc_timeout_s: float = 30.0
    open_timeout_s: float = 600.0  # the prefill: long prompts on a CPU take minutes
    overlap: bool = False  # model drafters draft the next round while the target verifies this one
    local_ngram: bool = False  # the gateway drafts by prompt lookup itself, with no draft service
    ngram_max: int = NGRAM_MAX  # longest suffix the gateway's lookup indexes
    plain_pipeline: int = PLAIN_PIPELINE
    plain_burst_ms: float = PLAIN_BURST_MS
    target_lookup: bool = True  # let the target run the gateway's lookup rule inside target-only calls
    continue_rounds: bool = True  # an n-gram service's round may go on as target-only decoding in the same call
    draft_max_running: int = 0  # beyond this many running generations a starting request decodes target-only
    cross_vocab: str = "auto"  # how a draft of another vocabulary drafts (speculation.cross_vocab)

    @classmethod
    def from_settings(cls, settings) -> GenerationOptions:
        return cls(
            rpc_timeout_s=settings.rpc_timeout_s,
            open_timeout_s=settings.open_timeout_s,
            overlap=settings.overlap_draft,
            local_ngram=settings.local_ngram,
            ngram_max=settings.local_ngram_max,
            plain_pipeline=settings.plain_pipeline,
            plain_burst_ms=settings.plain_burst_ms,
            target_lookup=settings.target_lookup,
            continue_rounds=settings.continue_rounds,
            draft_max_running=settings.draft_max_running,
            cross_vocab=settings.cross_vocab,
        )


@dataclass
class Positions:
    """Where the two sessions stand (sequence lengths) and which emitted tokens the drafter has yet to learn."""

    target: int = 0  # the target session's length (its last emitted token not yet in its KV cache)
    draft: int = 0  # the draft session's length
    produced: int = 0  # tokens emitted so far
    unsent: list[int] = field(default_factory=list)  # emitted tokens the drafter has not seen yet
    draft_has: int = 0  # emitted tokens to come that the draft already received with a draft-ahead
    rewind_to: int | None = None  # draft position to rewind to after a rejected draft-ahead
    sequence: list[int] | None = None  # prompt and emitted tokens, where a strategy tests them for repeats

    def advance(self, token_id: int) -> None:
        """One more emitted token."""
        if self.draft_has:
            self.draft_has -= 1  # sent with a draft-ahead already
        else:
            self.unsent.append(token_id)
        if self.sequence is not None:
            self.sequence.append(token_id)
        self.produced += 1


@dataclass
class GenerationStats:
    """What a response reports in `timings`: llama-server's keys always, tandem's split of round time on request."""

    prompt_n: int = 0
    prompt_ns: int = 0
    predicted_n: int = 0
    predicted_ns: int = 0
    rounds: int = 0  # verify rounds that carried a draft
    verify_calls: int = 0  # all verify calls, with or without a draft
    verify_steps: int = 0  # target steps those calls ran (a target-only call may run several)
    lookahead_rounds: int = 0  # rounds whose draft came from the n-gram lookahead, with no Propose call
    propose_calls: int = 0  # Propose calls to the draft service (drafts-ahead included)
    proposes_skipped: int = 0  # Propose calls not sent: the n-gram service could not draft there
    overlapped_rounds: int = 0  # rounds whose draft was drafted during the previous verification
    pipelined_rounds: int = 0  # target-only tokens sent before the previous call's answer
    follow_ups: int = 0  # target-only calls sent ahead with a lookup round
    follow_ups_used: int = 0  # ... that the round's outcome let run
    continued_rounds: int = 0  # rounds whose call went on as target-only decoding
    target_rounds: int = 0  # rounds the target drafted inside target-only calls with the gateway's rule
    tokens_before_draft: int = 0  # decoded target-only while the draft prefilled the prompt, then caught up
    draft_n: int = 0
    draft_n_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)
    draft_ns: int = 0  # wall time of Propose calls seen by the gateway
    verify_ns: int = 0  # wall time of Verify calls seen by the gateway
    draft_forward_ns: int = 0  # time inside the draft model's forward passes
    verify_forward_ns: int = 0  # time inside the target's forward passes
    verify_mask_ns: int = 0  # time the target spent on the grammar (constrained output), beside its forward passes
    draft_service_ns: int = 0  # wall time of Propose calls inside the draft service (the rest of draft_ns is gRPC)
    verify_service_ns: int = 0  # wall time of Verify calls inside the target service
    # off | on | degraded (draft failed mid-request) | stopped (drafting cannot pay here) | draft_context (the text
    # does not fit a draft of another vocabulary: target-only)
    speculation: str = "off"
    load_shed: bool = False  # started on a busy server (--draft-max-running): decoded target-only
    synthetic_acceptance: str = ""  # benchmark targets only: acceptance is imposed, the text is not valid
    k_chosen: int = 0  # sum of the draft lengths asked for, over rounds (adaptive k)
    k_rounds: int = 0
    translate_ns: int = 0  # a draft of another vocabulary: time both services spent translating text

    def observe_round(self, proposed: int, accepted: int) -> None:
        self.rounds += 1
        self.draft_n += proposed
        self.draft_n_accepted += accepted
        while len(self.accepted_per_position) < proposed:
            self.accepted_per_position.append(0)
            self.drafts_per_position.append(0)
        for i in range(proposed):
            self.drafts_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def timings(self, detail: bool = False) -> dict:
        """llama-server's `timings` keys (plus whether speculation ran); with `detail`, tandem's diagnostic split."""
        prompt_ms = self.prompt_ns / 1e6
        predicted_ms = self.predicted_ns / 1e6
        out = {
            "prompt_n": self.prompt_n,
            "prompt_ms": round(prompt_ms, 3),
            "prompt_per_token_ms": round(prompt_ms / self.prompt_n, 3) if self.prompt_n else None,
            "prompt_per_second": round(self.prompt_n / (prompt_ms / 1e3), 3) if prompt_ms > 0 else None,
            "predicted_n": self.predicted_n,
            "predicted_ms": round(predicted_ms, 3),
            "predicted_per_token_ms": round(predicted_ms / self.predicted_n, 3) if self.predicted_n else None,
            "predicted_per_second": round(self.predicted_n / (predicted_ms / 1e3), 3) if predicted_ms > 0 else None,
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
            "speculation": self.speculation,
            **({"load_shed": True} if self.load_shed else {}),
            **({"synthetic_acceptance": self.synthetic_acceptance} if self.synthetic_acceptance else {}),
        }
        if detail:
            out.update(self.diagnostics())
        return out

    def diagnostics(self) -> dict:
        """tandem's split of decode time and its round counters (the request field `timings_detail`)."""
        return {
            "acceptance_rate": round(self.draft_n_accepted / self.draft_n, 4) if self.draft_n else None,
            # Mean tokens emitted per verify round, bonus token included (vLLM's convention).
            "mean_accepted_length": round((self.draft_n_accepted + self.rounds) / self.rounds, 4)
            if self.rounds
            else None,
            "draft_length_mean": round(self.k_chosen / self.k_rounds, 3) if self.k_rounds else None,
            "rounds": self.rounds,
            "verify_calls": self.verify_calls,
            "verify_steps": self.verify_steps,
            "lookahead_rounds": self.lookahead_rounds,
            "propose_calls": self.propose_calls,
            "proposes_skipped": self.proposes_skipped,
            "overlapped_rounds": self.overlapped_rounds,
            "pipelined_rounds": self.pipelined_rounds,
            "follow_ups": self.follow_ups,
            "follow_ups_used": self.follow_ups_used,
            "continued_rounds": self.continued_rounds,
            "target_rounds": self.target_rounds,
            "tokens_before_draft": self.tokens_before_draft,
            "draft_compute_ms": round(self.draft_forward_ns / 1e6, 3),
            "verify_compute_ms": round(self.verify_forward_ns / 1e6, 3),
            "verify_mask_ms": round(self.verify_mask_ns / 1e6, 3),
            "translate_ms": round(self.translate_ns / 1e6, 3),
            "draft_rpc_ms": round(self.draft_ns / 1e6, 3),
            "verify_rpc_ms": round(self.verify_ns / 1e6, 3),
            "draft_service_ms": round(self.draft_service_ns / 1e6, 3),
            "verify_service_ms": round(self.verify_service_ns / 1e6, 3),
            "accepted_per_position": list(self.accepted_per_position),
            "drafts_per_position": list(self.drafts_per_position),
        }
