"""What chat and text completions share: prompt limits, running a Generation, text and stop handling, SSE.

The endpoint modules (chat.py, completions.py) only translate between their OpenAI shapes and these pieces.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

from services.gateway.costs import CostModel
from services.gateway.errors import OpenAIError, sse_error
from services.gateway.guards import Admission
from services.gateway.metrics import GatewayMetrics, observe_epoch
from services.gateway.protocol import SamplingFields
from services.gateway.speculation import Generation, GenerationOptions, GenerationRequest, GenerationStats
from services.gateway.text import TextAssembler
from services.gateway.upstream import Upstreams
from tandem.config import GatewaySettings
from tandem.errors import InvalidArgument
from tandem.grammar import Constraint
from tandem.v1 import tandem_pb2 as pb

# Default draft lengths when --n-max is unset (docs/decisions/0001).
MODEL_N_MAX = 8
NGRAM_N_MAX = 32


@dataclass
class Delta:
    """A piece of the response: new visible text, the tokens that produced it, and the end reason when done."""

    text: str = ""
    tokens: list[pb.Token] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Outcome:
    text: str
    tokens: list[pb.Token]
    finish_reason: str
    stats: GenerationStats


class Serving:
    def __init__(self, upstreams: Upstreams, settings: GatewaySettings, metrics: GatewayMetrics | None = None) -> None:
        self.up = upstreams
        self.metrics = metrics
        self.settings = settings
        # No more generations at once than the target has session slots: the rest wait in the queue.
        slots = upstreams.target_info.max_sessions or settings.max_concurrent
        self.admission = Admission(min(settings.max_concurrent, slots), settings.max_queue)
        # The deployment's measured step costs, shared by all requests (adaptive k).
        self.costs = CostModel(running=lambda: self.admission.running)
        if metrics is not None:
            self.costs.governor.on_epoch = functools.partial(observe_epoch, metrics)
        self.options = GenerationOptions.from_settings(settings)
        self.model_name = settings.model_name or upstreams.target_info.model_name
        self.context_size = upstreams.target_info.context_size
        ngram = settings.local_ngram or upstreams.draft_is_ngram
        self.default_n_max = settings.n_max if settings.n_max is not None else NGRAM_N_MAX if ngram else MODEL_N_MAX

    def check_model(self, requested: str | None) -> None:
        """Accept our own id (and a missing one); anything else is a 404 like OpenAI's."""
        if requested and requested not in (self.model_name, "tandem", "default"):
            raise OpenAIError(
                404,
                f"model {requested!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )

    async def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        reply = await self.up.target.Tokenize(
            pb.TokenizeRequest(text=text, add_special=add_special, parse_special=parse_special),
            timeout=self.settings.rpc_timeout_s,
        )
        return list(reply.token_ids)

    def generation_request(
        self,
        req: SamplingFields,
        prompt_ids: Sequence[int],
        max_tokens: int | None,
        top_logprobs: int,
        constraint: Constraint | None = None,
        constraint_param: str = "response_format",
    ) -> GenerationRequest:
        """`constraint`: one the endpoint made (a forced tool call), instead of the request's response_format."""
        n_prompt = len(prompt_ids)
        if n_prompt == 0:
            raise OpenAIError(400, "the prompt is empty", "prompt")
        room = self.context_size - n_prompt
        if room < 1:
            raise OpenAIError(
                400,
                f"the prompt has {n_prompt} tokens; this model's context is {self.context_size} tokens",
                "messages",
                "context_length_exceeded",
            )
        # Beyond the room left (or the operator's --max-tokens-limit) max_tokens is capped and the answer ends with
        # finish_reason "length", as llama-server does: agents such as Claude Code always ask for far more.
        if max_tokens is None:
            max_tokens = self.settings.max_tokens_default
        max_tokens = min(max_tokens, room, self.settings.max_tokens_limit)
        n_max = self.default_n_max if req.speculative_n_max is None else req.speculative_n_max
        n_min = self.settings.n_min if req.speculative_n_min is None else req.speculative_n_min
        ngram_min = self._ngram_min(req.speculative_ngram_min)
        draft_types = self._draft_types(req.speculative_type)
        constraint = self._constraint(req, constraint, constraint_param)
        return GenerationRequest(
            prompt_token_ids=list(prompt_ids),
            sampling=req.sampling_params(),
            max_tokens=max_tokens,
            n_max=n_max,
            n_min=n_min,
            top_logprobs=top_logprobs,
            adaptive=self._adaptive(req),
            overlap=req.speculative_overlap,
            cross_vocab=req.speculative_cross_vocab,
            draft_types=draft_types,
            ngram_min=ngram_min,
            constraint=constraint,
        )

    def _draft_types(self, requested: str | None) -> tuple[str, ...]:
        """`speculative.type` as the drafting types to open the draft session with (empty: the deployment's own);
        a type the deployment does not offer is a 400 that names what it offers."""
        if requested is None:
            return ()
        if self.settings.local_ngram:
            offered: tuple[str, ...] = ("ngram",)
        elif self.up.draft_info is not None:
            offered = tuple(self.up.draft_info.drafter.split(","))
        else:
            offered = ()
        wanted = tuple(dict.fromkeys(t.strip() for t in requested.split(",") if t.strip()))
        unknown = [t for t in wanted if t not in offered]
        if not wanted or unknown:
            raise OpenAIError(
                400,
                f"speculative.type {requested!r}: this deployment drafts with {', '.join(offered) or 'nothing'}",
                "speculative.type",
                "invalid_value",
            )
        return wanted if len(offered) > 1 else ()  # one type offered: it is the deployment's own

    def _constraint(self, req: SamplingFields, given: Constraint | None, param: str) -> Constraint | None:
        """The request's constraint, compiled here once so that a bad schema is a 400 that names the parameter (the
        target compiles it again for its vocabulary)."""
        requested = req.response_format.constraint() if req.response_format is not None else None
        if given is not None and requested is not None:
            raise OpenAIError(400, "response_format cannot be combined with a forced tool call", "response_format")
        constraint = given or requested
        if constraint is None:
            return None
        param = param if given is not None else "response_format"
        if not self.up.target_info.capabilities.constraints:
            raise OpenAIError(400, "this target does not support constrained output", param)
        try:
            constraint.grammar()
        except InvalidArgument as exc:
            raise OpenAIError(400, f"{param}: {exc}", param, "invalid_value") from exc
        return constraint

    def _ngram_min(self, requested: int | None) -> int:
        """The shortest suffix match that drafts, for this request's lookup in the gateway."""
        if requested is None:
            return self.settings.local_ngram_min
        param = "speculative.ngram_min"
        if not self.settings.local_ngram:
            raise OpenAIError(
                400, f"{param} needs the gateway's own n-gram lookup (--local-ngram)", param, "invalid_value"
            )
        if requested > self.settings.local_ngram_max:
            raise OpenAIError(
                400,
                f"{param} {requested} exceeds the longest suffix looked up ({self.settings.local_ngram_max})",
                param,
                "invalid_value",
            )
        return requested

    def _adaptive(self, req) -> bool:
        """The request's own choice; else the server's default, except for seeded sampled requests: the draft length
        decides how the target's random stream is consumed, and timing-driven choices would make the same seed give
        different text. A request that asks for adaptive k explicitly accepts that."""
        if req.speculative_adaptive is not None:
            return req.speculative_adaptive
        return self.settings.adaptive_k and not (req.seed is not None and req.temperature > 0)

    def start(self, gen_req: GenerationRequest) -> Generation:
        return Generation(self.up, gen_req, self.options, self.metrics, self.costs, lambda: self.admission.running)

    async def deltas(self, generation: Generation, stop: Sequence[str]) -> AsyncIterator[Delta]:
        """Visible text as it becomes safe to show, ending with a Delta that carries the finish reason."""
        text = TextAssembler(stop)
        pending: list[pb.Token] = []
        finish = "length"
        async with self.admission.slot(), aclosing(generation.tokens()) as tokens:
            async for token in tokens:
                pending.append(token)
                if token.is_eog:
                    finish = "stop"
                    break
                text.feed(token.piece)
                if text.stopped:
                    finish = "stop"
                    break
                chunk = text.take()
                if chunk or (len(pending) > 0 and generation.req.top_logprobs >= 0):
                    yield Delta(chunk, pending)
                    pending = []
        text.finish()
        yield Delta(text.take(final=True), pending, finish)

    async def complete(self, generation: Generation, stop: Sequence[str]) -> Outcome:
        parts: list[str] = []
        tokens: list[pb.Token] = []
        finish = "length"
        async for delta in self.deltas(generation, stop):
            parts.append(delta.text)
            tokens.extend(delta.tokens)
            finish = delta.finish_reason or finish
        return Outcome("".join(parts), tokens, finish, generation.stats)


def usage(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_n,
        "completion_tokens": stats.predicted_n,
        "total_tokens": stats.prompt_n + stats.predicted_n,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


async def with_first(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    """The deltas of a stream whose first one was read before the response started (for its HTTP status)."""
    yield first
    async for delta in rest:
        yield delta


def _payloads(chunk: dict | list[dict] | None) -> list[dict]:
    return chunk if isinstance(chunk, list) else [chunk] if chunk is not None else []


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def stream_events(
    first: Delta | None,
    rest: AsyncIterator[Delta],
    chunk: Callable[[Delta], dict | list[dict] | None],
    tail: Callable[[], list[dict]],
) -> AsyncIterator[str]:
    """SSE frames: a chunk per delta, then the tail (final/usage chunks), then [DONE]; errors become an error event."""
    try:
        async with aclosing(rest):
            if first is not None:
                for payload in _payloads(chunk(first)):
                    yield sse(payload)
            async for delta in rest:
                for payload in _payloads(chunk(delta)):
                    yield sse(payload)
        for payload in tail():
            yield sse(payload)
    except Exception as exc:  # the status line is already sent: report in-band, then end the stream cleanly
        yield sse_error(exc)
    yield "data: [DONE]\n\n"
