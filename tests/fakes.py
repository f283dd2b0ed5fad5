"""Scripted upstreams for unit tests of the speculative strategies: no model, no network, exact call logs.

The fake target is a greedy "model" whose continuation is a fixed reference text: at sequence length L it emits
`text[L - len(prompt)]`. It answers Verify as the real target does for greedy sessions (accept the drafts that match,
add its own token; Continuation.plain_steps, stop_at_repeat and lookup with the same tests, from tandem.ngram and
tandem.sessions), refuses a call at the wrong position or at a repeat with FAILED_PRECONDITION, and records every call.
The fake model draft proposes the reference except at the positions it is told to get wrong; the n-gram draft is the
real NgramDrafter over a real Session. Calls are served in the order they are sent, as the target's stream does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np

from services.draft.drafters import NgramDrafter
from services.gateway.streams import upstream_error
from tandem.convert import lookup_rule_from_pb
from tandem.sampling import SamplingParams
from tandem.sessions import Session
from tandem.v1 import tandem_pb2 as pb

EOG = 0  # the reference texts' end-of-generation token id
STEP_NS = 1_000_000  # a fake forward pass: 1 ms plus 0.1 ms a token
TOKEN_NS = 100_000


def _session(session_id: str, tokens: Sequence[int]) -> Session:
    return Session(
        session_id, 0, tuple(tokens), SamplingParams(temperature=0.0), np.random.default_rng(0), tokens=list(tokens)
    )


def _refused(details: str) -> grpc.aio.AioRpcError:
    return upstream_error(grpc.StatusCode.FAILED_PRECONDITION, details)


@dataclass
class FakeTarget:
    """The target service and its VerifyStream, as the gateway's Upstreams expose them."""

    text: list[int]
    prompt: list[int] = field(default_factory=list)
    continues_rounds: bool = True
    prompt_lookup: bool = True
    calls: list[tuple] = field(default_factory=list)
    session: Session | None = None

    def info(self) -> pb.InfoResponse:
        return pb.InfoResponse(
            model_name="fake-target",
            capabilities=pb.Capabilities(prompt_lookup=self.prompt_lookup, continues_rounds=self.continues_rounds),
        )

    # ---------------------------------------------------------------- Target stub

    async def Open(self, request: pb.OpenRequest, timeout: float | None = None, metadata=None) -> pb.OpenResponse:
        item = request.items[0]
        self.prompt = list(item.prompt_token_ids)
        self.session = _session(item.session_id, self.prompt)
        self.calls.append(("open", len(self.prompt)))
        first = self._next()
        self.session.tokens.append(first)
        return pb.OpenResponse(
            results=[pb.OpenResult(session_id=item.session_id, position=len(self.prompt) + 1, first_token=_tok(first))]
        )

    async def Close(self, request: pb.CloseRequest, timeout: float | None = None) -> pb.CloseResponse:
        self.calls.append(("close",))
        return pb.CloseResponse(closed=1)

    # ---------------------------------------------------------------- VerifyStream (Upstreams.verify)

    async def call(self, request: pb.VerifyRequest, timeout: float) -> pb.VerifyResponse:
        """Served at once, in the order sent (before the first await), then answered a loop turn later."""
        try:
            reply = self._verify(request.items[0])
        finally:
            await asyncio.sleep(0)
        return reply

    def _next(self) -> int:
        assert self.session is not None
        i = len(self.session.tokens) - len(self.prompt)
        return self.text[i] if i < len(self.text) else EOG

    def _verify(self, item: pb.VerifyItem) -> pb.VerifyResponse:
        s = self.session
        assert s is not None
        cont = item.continuation
        drafts = list(item.draft_token_ids)
        rule = cont.lookup if cont.HasField("lookup") else None
        self.calls.append(
            ("verify", item.position, tuple(drafts), cont.plain_steps, cont.stop_at_repeat, rule is not None)
        )
        if item.position != s.position:
            raise _refused(f"session is at {s.position}, the call assumed {item.position}")
        if not drafts and cont.stop_at_repeat and s.ends_with_repeat(cont.stop_at_repeat):
            raise _refused(f"the sequence ends with a repeat of {cont.stop_at_repeat} tokens")
        tokens: list[pb.Token] = []
        rounds: list[pb.LookupRound] = []
        first, match_len = drafts, 0
        if not drafts and rule is not None:  # the caller's rule drafts before every step, the first included
            first, match_len = s.lookup_draft(lookup_rule_from_pb(rule), 1 << 20)
        accepted = self._round(first, tokens)
        steps, forward = 1, STEP_NS + TOKEN_NS * (len(first) + 1)
        if (drafts and cont.plain_steps > 1) or (first and not drafts):  # a continued round, or a lookup round
            rounds.append(
                pb.LookupRound(offset=0, match_len=match_len, drafted=len(first), accepted=accepted, forward_ns=forward)
            )
        if not drafts:
            accepted = 0
        end = item.position + max(cont.plain_steps, 1)
        while s.position < end and tokens[-1].id != EOG:
            if cont.stop_at_repeat and s.ends_with_repeat(cont.stop_at_repeat):
                break
            lookup_drafts: list[int] = []
            match_len = 0
            if rule is not None:
                lookup_drafts, match_len = s.lookup_draft(lookup_rule_from_pb(rule), 1 << 20)
            offset = len(tokens)
            n = self._round(lookup_drafts, tokens)
            step_ns = STEP_NS + TOKEN_NS * (len(lookup_drafts) + 1)
            steps, forward = steps + 1, forward + step_ns
            if lookup_drafts:
                rounds.append(
                    pb.LookupRound(
                        offset=offset, match_len=match_len, drafted=len(lookup_drafts), accepted=n, forward_ns=step_ns
                    )
                )
        result = pb.VerifyResult(
            session_id=s.session_id, num_accepted=accepted, tokens=tokens, position=s.position, lookup_rounds=rounds
        )
        timing = pb.Timing(forward_ns=forward, total_ns=forward, step_sequences=1, step_tokens=len(drafts) + 1)
        timing.steps = steps
        return pb.VerifyResponse(results=[result], timing=timing)

    def _round(self, drafts: list[int], out: list[pb.Token]) -> int:
        """Greedy verification of `drafts`: the matching prefix, then the target's own token."""
        s = self.session
        assert s is not None
        n = 0
        for d in drafts:
            if d != self._next():
                break
            s.tokens.append(d)
            out.append(_tok(d))
            n += 1
            if d == EOG:
                return n
        own = self._next()
        s.tokens.append(own)
        out.append(_tok(own))
        return n


def _tok(token_id: int) -> pb.Token:
    return pb.Token(id=token_id, piece=str(token_id).encode(), is_eog=token_id == EOG)


@dataclass
class FakeDraft:
    """The draft service and its ProposeStream: a model that gets the reference wrong at `wrong` sequence positions
    (it proposes token 1 there), or the real NgramDrafter (`ngram=True`)."""

    text: list[int]
    wrong: set[int] = field(default_factory=set)
    ngram: bool = False
    ngram_min: int = 2
    calls: list[tuple] = field(default_factory=list)
    session: Session | None = None
    prompt: list[int] = field(default_factory=list)
    fail_after: int | None = None  # Propose calls answered before the service "dies" (UNAVAILABLE)

    def __post_init__(self) -> None:
        self.drafter = NgramDrafter(self.ngram_min, 8) if self.ngram else None

    def info(self) -> pb.InfoResponse:
        caps = pb.Capabilities()
        if self.drafter is not None:
            caps.proposes_after_repeat = self.drafter.proposes_after_repeat
        return pb.InfoResponse(model_name="fake-draft", drafter="ngram" if self.ngram else "model", capabilities=caps)

    async def Open(self, request: pb.OpenRequest, timeout: float | None = None, metadata=None) -> pb.OpenResponse:
        item = request.items[0]
        self.prompt = list(item.prompt_token_ids)
        self.session = _session(item.session_id, self.prompt)
        if self.drafter is not None:
            self.drafter.open([self.session])
        self.calls.append(("open", len(self.prompt)))
        return pb.OpenResponse(results=[pb.OpenResult(session_id=item.session_id, position=len(self.prompt))])

    async def Close(self, request: pb.CloseRequest, timeout: float | None = None) -> pb.CloseResponse:
        self.calls.append(("close",))
        return pb.CloseResponse(closed=1)

    async def call(self, request: pb.ProposeRequest, timeout: float) -> pb.ProposeResponse:
        try:
            reply = self._propose(request.items[0])
        finally:
            await asyncio.sleep(0)
        return reply

    def _propose(self, item: pb.ProposeItem) -> pb.ProposeResponse:
        s = self.session
        assert s is not None
        self.calls.append(("propose", item.position, tuple(item.append_token_ids), item.max_tokens, item.rewind))
        if self.fail_after is not None and sum(c[0] == "propose" for c in self.calls) > self.fail_after:
            raise upstream_error(grpc.StatusCode.UNAVAILABLE, "draft: the service is gone")
        if item.rewind and item.position <= s.position:
            del s.tokens[item.position :]
            if self.drafter is not None:
                self.drafter.truncated(s)
        elif item.position != s.position:
            raise _refused(f"draft session is at {s.position}, the call assumed {item.position}")
        start = s.position
        s.tokens.extend(item.append_token_ids)
        if self.drafter is not None:
            self.drafter.appended(s, start)
            draft = self.drafter.propose(s, item.max_tokens)
            proposal = pb.Proposal(
                session_id=s.session_id, position=s.position, token_ids=draft.tokens, match_len=draft.match_len
            )
        else:
            tokens: list[int] = []
            for i in range(item.max_tokens):
                at = s.position + i
                j = at - len(self.prompt)
                tokens.append(1 if at in self.wrong or j >= len(self.text) else self.text[j])
            proposal = pb.Proposal(session_id=s.session_id, position=s.position, token_ids=tokens)
        forward = TOKEN_NS * len(proposal.token_ids)
        return pb.ProposeResponse(proposals=[proposal], timing=pb.Timing(forward_ns=forward, total_ns=forward))


@dataclass
class FakeUpstreams:
    """What Generation reads of services.gateway.upstream.Upstreams."""

    target_fake: FakeTarget
    draft_fake: FakeDraft | None = None

    def __post_init__(self) -> None:
        self.target = self.target_fake
        self.target_info = self.target_fake.info()
        self.verify = self.target_fake
        self.draft = self.draft_fake
        self.draft_info = self.draft_fake.info() if self.draft_fake is not None else None
        self.propose = self.draft_fake

    @property
    def draft_is_ngram(self) -> bool:
        return self.draft_info is not None and self.draft_info.drafter == "ngram"

    @property
    def draft_cross_vocabulary(self) -> bool:
        """The fakes share one vocabulary: no draft drafts in text here (tests/test_cross_vocab_e2e.py does)."""
        return False
