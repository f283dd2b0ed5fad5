"""Prometheus metrics of the gateway, named like vLLM's and llama.cpp's so existing dashboards translate.

Speculation counters follow vLLM's spec_decode metrics: drafts, draft tokens, accepted tokens, accepted tokens per
draft position. The services' session counts and KV usage are read from their Info at scrape time, so /metrics on
the gateway shows the whole stack.
"""

from __future__ import annotations

import asyncio
import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.gateway.costs import CostModel
from tandem.v1 import tandem_pb2 as pb

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)
PRICED_DRAFTS_SHOWN = 8  # /metrics shows the price of rounds with up to this many drafts (longer ones extend the line)
RATE_BUCKETS = (1, 2, 5, 10, 20, 40, 60, 80, 100, 150, 200, 300, 500, 800, 1200, 2000)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "tandem_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("tandem_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter("tandem_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram(
            "tandem_time_to_first_token_seconds", "prefill until the first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            "tandem_inter_token_latency_seconds",
            "time between consecutive tokens (tokens of one accepted draft arrive together)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_rate = Histogram(
            "tandem_decode_tokens_per_second", "decode rate of each finished request", buckets=RATE_BUCKETS, registry=r
        )
        self.num_drafts = Counter("tandem_spec_decode_num_drafts", "verify rounds that carried a draft", registry=r)
        self.num_draft_tokens = Counter("tandem_spec_decode_num_draft_tokens", "draft tokens proposed", registry=r)
        self.num_accepted = Counter("tandem_spec_decode_num_accepted_tokens", "draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter(
            "tandem_spec_decode_num_accepted_tokens_per_pos",
            "accepted draft tokens by position in the draft (0-based)",
            ["position"],
            registry=r,
        )
        self._accepted_at: list = []  # the children of accepted_per_pos, by position
        self.round_seconds = Histogram(
            "tandem_round_seconds", "wall time of one speculative round", buckets=LATENCY_BUCKETS, registry=r
        )
        self.round_overhead = Histogram(
            "tandem_round_overhead_seconds",
            "round time outside draft and target compute (gRPC, Python, orchestration)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.active_requests = Gauge("tandem_active_requests", "requests being generated", registry=r)
        self.load_epochs = Counter(
            "tandem_load_epochs",
            "epochs under load the load governor recorded, by generations running and whether drafts were sent",
            ["running", "drafts"],
            registry=r,
        )
        self.load_epoch_rate = Gauge(
            "tandem_load_epoch_tokens_per_second",
            "tokens a second all generations delivered in the last recorded epoch of that kind",
            ["running", "drafts"],
            registry=r,
        )
        # What the gateway prices rounds at now, as a lookup round's draft length is chosen (scraped: why drafts go
        # out or not on this deployment). Empty until the target's steps have been measured.
        self.price_round = Gauge(
            "tandem_price_round_seconds",
            "priced cost of a round with this many draft tokens (0: a plain round), before the load governor's verdict",
            ["drafts"],
            registry=r,
        )
        self.price_plain_token = Gauge(
            "tandem_price_plain_token_seconds", "priced cost of a token decoded without a draft", registry=r
        )
        self.price_overhead = Gauge(
            "tandem_price_round_overhead_seconds",
            "measured time of a round outside the forward passes (stepping alone where measured)",
            registry=r,
        )
        self.price_overhead_all = Gauge(
            "tandem_price_round_overhead_all_seconds",
            "measured time of a round outside the forward passes and its wait at the target, over every round",
            registry=r,
        )
        self.price_sequences = Gauge(
            "tandem_price_step_sequences",
            "mean sessions per target step (from 1.5 rounds are priced as a share of a batched step)",
            registry=r,
        )
        for unknown in (self.price_plain_token, self.price_overhead, self.price_overhead_all, self.price_sequences):
            unknown.set(math.nan)  # until measured (Prometheus's NaN: no value yet), not a price of 0
        self.governor_allows = Gauge(
            "tandem_load_governor_allows_drafts", "1 while the load governor's current epoch allows drafts", registry=r
        )
        self.synthetic = Gauge(
            "tandem_synthetic_acceptance",
            "1 when the target imposes synthetic acceptance (benchmark targets only; the text is not valid)",
            registry=r,
        )
        self.degraded = Counter(
            "tandem_speculation_degraded", "requests that lost their draft and continued target-only", registry=r
        )
        self.upstream_up = Gauge("tandem_upstream_up", "1 if the service answered Info", ["service"], registry=r)
        self.sessions = Gauge("tandem_sessions_active", "open sessions on each service", ["service"], registry=r)
        self.kv_tokens = Gauge("tandem_kv_tokens", "tokens held in each service's KV cache", ["service"], registry=r)
        self.kv_capacity = Gauge(
            "tandem_kv_capacity_tokens", "KV cells of each service's context", ["service"], registry=r
        )
        # Each service's llama_decode calls since it started, and those whose batch layout changed from the call
        # before (on CUDA they run without a replayed graph: decision 0022), as the service last reported them.
        self.decode_calls = Gauge(
            "tandem_engine_decode_calls", "llama_decode calls of each service's engine", ["service"], registry=r
        )
        self.decode_seconds = Gauge(
            "tandem_engine_decode_seconds", "forward time of those calls", ["service"], registry=r
        )
        self.reshaped_calls = Gauge(
            "tandem_engine_reshaped_calls",
            "of those calls, the ones whose batch layout differed from the call before",
            ["service"],
            registry=r,
        )
        self.reshaped_seconds = Gauge(
            "tandem_engine_reshaped_seconds", "forward time of the reshaped calls", ["service"], registry=r
        )
        # tandem's split of decode time, summed over finished requests (a response has it with `timings_detail`).
        self.calls = Counter("tandem_upstream_calls", "Verify and Propose calls sent", ["service"], registry=r)
        self.rpc_seconds = Counter(
            "tandem_upstream_rpc_seconds", "wall time of those calls as the gateway saw them", ["service"], registry=r
        )
        self.compute_seconds = Counter(
            "tandem_upstream_compute_seconds", "time inside each model's forward passes", ["service"], registry=r
        )
        self.target_steps = Counter(
            "tandem_upstream_target_steps",
            "engine steps of those calls, once per call (a step shared by n calls counts n times, as compute does)",
            registry=r,
        )
        self.round_kinds = Counter(
            "tandem_round_kinds",
            "rounds and calls by how they were sent (lookahead, overlapped, pipelined, follow_up, continued, ...)",
            ["kind"],
            registry=r,
        )

    def observe_round(self, proposed: int, accepted: int, round_ns: int, compute_ns: int) -> None:
        self.round_seconds.observe(round_ns / 1e9)
        self.round_overhead.observe(max(round_ns - compute_ns, 0) / 1e9)
        if proposed:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(proposed)
            self.num_accepted.inc(accepted)
            per_pos = self._accepted_at
            while len(per_pos) < accepted:  # .labels() looks the child up under a lock: ~2 us a call, per position
                per_pos.append(self.accepted_per_pos.labels(position=str(len(per_pos))))
            for i in range(accepted):
                per_pos[i].inc()

    def observe_generation(self, stats) -> None:
        """Add a finished request's diagnostic split (a GenerationStats) to the totals."""
        for service, calls, rpc_ns, forward_ns in (
            ("target", stats.verify_calls, stats.verify_ns, stats.verify_forward_ns),
            ("draft", stats.propose_calls, stats.draft_ns, stats.draft_forward_ns),
        ):
            if calls:
                self.calls.labels(service=service).inc(calls)
                self.rpc_seconds.labels(service=service).inc(rpc_ns / 1e9)
                self.compute_seconds.labels(service=service).inc(forward_ns / 1e9)
        self.target_steps.inc(stats.verify_steps)
        for kind, n in (
            ("lookahead", stats.lookahead_rounds),
            ("overlapped", stats.overlapped_rounds),
            ("pipelined", stats.pipelined_rounds),
            ("follow_up", stats.follow_ups),
            ("follow_up_used", stats.follow_ups_used),
            ("continued", stats.continued_rounds),
            ("target_drafted", stats.target_rounds),
            ("propose_skipped", stats.proposes_skipped),
        ):
            if n:
                self.round_kinds.labels(kind=kind).inc(n)

    async def refresh_upstreams(self, stubs: dict[str, object]) -> None:
        async def one(name: str, stub) -> None:
            try:
                info = await stub.Info(pb.InfoRequest(), timeout=1.0)
            except Exception:
                self.upstream_up.labels(service=name).set(0)
                return
            self.upstream_up.labels(service=name).set(1)
            self.sessions.labels(service=name).set(info.load.active_sessions)
            self.kv_tokens.labels(service=name).set(info.load.kv_tokens)
            self.kv_capacity.labels(service=name).set(info.context_size)
            self.decode_calls.labels(service=name).set(info.load.decode_calls)
            self.decode_seconds.labels(service=name).set(info.load.decode_ns / 1e9)
            self.reshaped_calls.labels(service=name).set(info.load.reshaped_calls)
            self.reshaped_seconds.labels(service=name).set(info.load.reshaped_ns / 1e9)
            if name == "target":
                self.synthetic.set(1 if info.capabilities.synthetic_acceptance else 0)

        await asyncio.gather(*(one(n, s) for n, s in stubs.items() if s is not None))

    def observe_prices(self, costs: CostModel, max_draft: int) -> None:
        """The cost model's prices now (scrape time), as `MatchLengthPolicy.pricing` reads them for a lookup round."""
        self.price_sequences.set(costs.sequences)
        overhead = costs.lone_overhead_ns
        self.price_overhead.set(overhead / 1e9 if overhead is not None else math.nan)
        self.price_overhead_all.set(costs.overhead_ns / 1e9 if costs.overhead_ns is not None else math.nan)
        self.governor_allows.set(1 if costs.governor.allowing else 0)
        rounds = costs.round_costs(min(max_draft, PRICED_DRAFTS_SHOWN), priced_alone=True, governed=False)
        if rounds is None:
            return
        for k, ns in enumerate(rounds):
            self.price_round.labels(drafts=str(k)).set(ns / 1e9)
        plain = costs.plain_from_round(rounds[0])
        self.price_plain_token.set(plain / 1e9 if plain is not None else math.nan)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def observe_epoch(metrics: GatewayMetrics, level: str, drafted: bool, rate: float) -> None:
    """One epoch the load governor recorded (`LoadGovernor.on_epoch`)."""
    labels = {"running": level, "drafts": "yes" if drafted else "no"}
    metrics.load_epochs.labels(**labels).inc()
    metrics.load_epoch_rate.labels(**labels).set(rate)
