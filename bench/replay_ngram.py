"""`python -m bench.replay_ngram RESULTS.json`: replay prompt-lookup draft-length policies on recorded texts.

A benchmark run compares configurations on texts that differ once a near-tie flips (batched verification moves
logits), and on 2 cores its noise is a few percent: too coarse to choose between draft-length policies. This replays
the target-only texts of a run (`results.json` from `python -m bench`) through the real drafter (`tandem.ngram`) and
the real policies (`services.gateway.adaptive`), round by round: a draft token is accepted when it equals the
recorded next token, and a round costs the verify curve `fixed + per_token * (k + 1)` (+ overhead when it drafted,
+ a pipelined step's share of messages when not). Deterministic, so two policies' difference is the policies'.

Sampled texts replay exactly too, in distribution: an n-gram draft token x is deterministic, so the target accepts it
with probability p(x), the chance that its own sample is x, and after a rejection draws from p without x, its sample
given that it is not x. A recorded target-only sample therefore decides acceptance as the live rounds would (one
text per prompt here, so sampled rows carry that text's luck).

Defaults are this 2-core CPU's measured costs for SmolLM2-135M at a ~700-token context (verify 1 token 14.5 ms,
each extra token +4.7 ms; about 2 ms of gRPC and Python per speculative round, 0.7 ms per pipelined plain step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from services.gateway.adaptive import DraftLengthPolicy, MatchLengthPolicy
from services.gateway.costs import CostModel
from tandem.ngram import NGRAM_MAX, NGRAM_MIN, NgramIndex, ngram_draft_matched

# A policy: (propose(tokens, index, cap) -> draft, observe(draft, accepted, verify_ns)).
Policy = tuple[Callable[[list[int], NgramIndex, int], list[int]], Callable[[list[int], int, int], None]]


class Costs:
    def __init__(self, fixed_ms: float, per_token_ms: float, overhead_ms: float, plain_ms: float) -> None:
        self.fixed_ms, self.per_token_ms, self.overhead_ms, self.plain_ms = (
            fixed_ms,
            per_token_ms,
            overhead_ms,
            plain_ms,
        )

    curve: list[float] | None = None  # measured forward ms of a step of 1, 2, ... tokens (then the last slope)

    def verify_ms(self, k: int) -> float:
        if self.curve:
            c = self.curve
            if k < len(c):
                return c[k]
            slope = c[-1] - c[-2] if len(c) > 1 else self.per_token_ms
            return c[-1] + slope * (k + 1 - len(c))
        return self.fixed_ms + self.per_token_ms * k

    def round_ms(self, k: int) -> float:
        return self.verify_ms(k) + (self.overhead_ms if k else self.plain_ms)


def fixed(k_max: int) -> Policy:
    return (lambda tokens, index, cap: ngram_draft_matched(index, tokens, min(k_max, cap))[0]), (lambda *_: None)


def _fed(costs: CostModel, overhead_ms: float, plain_ms: float) -> Callable[[list[int], int, int], None]:
    def feed(draft: list[int], accepted: int, verify_ns: int) -> None:
        costs.observe_verify(len(draft) + 1, 1, verify_ns)
        if draft:
            costs.observe_overhead(overhead_ms * 1e6)
        else:
            costs.observe_plain_token(verify_ns + plain_ms * 1e6)

    return feed


def by_position(k_max: int, overhead_ms: float, plain_ms: float) -> Policy:
    """DraftLengthPolicy: k chosen before the lookup, from acceptance by draft position."""
    costs = CostModel()
    policy = DraftLengthPolicy(costs, 0, k_max)
    feed = _fed(costs, overhead_ms, plain_ms)

    def propose(tokens: list[int], index: NgramIndex, cap: int) -> list[int]:
        k = policy.choose(cap)
        return ngram_draft_matched(index, tokens, k)[0] if k else []

    def observe(draft: list[int], accepted: int, verify_ns: int) -> None:
        feed(draft, accepted, verify_ns)
        if draft:
            policy.tracker.observe(len(draft), accepted)

    return propose, observe


def by_match(k_max: int, overhead_ms: float, plain_ms: float) -> Policy:
    """MatchLengthPolicy (the gateway's --local-ngram with adaptive k): the lookup first, then how much to keep."""
    costs = CostModel()
    policy = MatchLengthPolicy(costs)
    feed = _fed(costs, overhead_ms, plain_ms)

    def propose(tokens: list[int], index: NgramIndex, cap: int) -> list[int]:
        draft, match = ngram_draft_matched(index, tokens, min(k_max, cap))
        return draft[: policy.choose(match, len(draft))]

    def observe(draft: list[int], accepted: int, verify_ns: int) -> None:
        feed(draft, accepted, verify_ns)
        policy.observe(len(draft), accepted)

    return propose, observe


def replay(
    prompt: list[int], output: list[int], policy: Policy, costs: Costs, n_min: int = NGRAM_MIN, n_max: int = NGRAM_MAX
) -> float:
    """Milliseconds to produce `output` after `prompt` with `policy`, looking up suffixes of n_min..n_max tokens."""
    propose, observe = policy
    tokens, index = list(prompt), NgramIndex(n_min, n_max)
    i, total = 0, 0.0
    while i < len(output):
        index.extend(tokens)
        draft = propose(tokens, index, len(output) - i - 1)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[i + accepted]:
            accepted += 1
        total += costs.round_ms(len(draft))
        observe(draft, accepted, int(costs.verify_ms(len(draft)) * 1e6))
        emitted = min(accepted + 1, len(output) - i)
        tokens += output[i : i + emitted]
        i += emitted
    return total


def load_texts(results: Path) -> list[tuple[str, list[int], list[int]]]:
    """(workload, prompt tokens, output tokens) of every target-only record, tokenized as served."""
    from bench.workloads import workloads
    from services.gateway.chat_template import ChatTemplate
    from tandem.config import EngineSettings
    from tandem.engine import Engine
    from tandem.models import default_model_path

    data = json.loads(results.read_text())
    model = data.get("meta", {}).get("model") or str(default_model_path())
    engine = Engine(EngineSettings(model=model, n_ctx=256, max_sessions=1))
    template = ChatTemplate(engine.chat_template)
    loads = {w.name: w for w in workloads(False)}
    out = []
    for record in data["records"]:
        load = loads.get(record["workload"])
        if record["config"] != "target-only" or load is None:
            continue
        rendered = template.render([{"role": "user", "content": load.prompts[record["prompt"]]}])
        prompt = engine.tokenize(rendered, add_special=False, parse_special=True)
        out.append((record["workload"], prompt, engine.tokenize(record["text"], add_special=False)))
    engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="results.json of a `python -m bench` run")
    parser.add_argument("--ks", default="2,4,8,16,32", help="fixed draft lengths to compare")
    parser.add_argument("--fixed-ms", type=float, default=14.5)
    parser.add_argument("--per-token-ms", type=float, default=4.7)
    parser.add_argument("--overhead-ms", type=float, default=2.0)
    parser.add_argument("--plain-ms", type=float, default=0.7)
    parser.add_argument(
        "--curve",
        help="measured verify ms of steps of 1,2,... tokens, comma-separated (replaces the line; the last two points "
        "extend it), e.g. 12,24,30,36,44",
    )
    parser.add_argument("--ngram-min", type=int, default=NGRAM_MIN, help="shortest suffix match that drafts")
    parser.add_argument("--ngram-max", type=int, default=NGRAM_MAX, help="longest suffix looked up")
    parser.add_argument("--workloads", default="", help="comma-separated subset of workload names")
    args = parser.parse_args(argv)
    costs = Costs(args.fixed_ms, args.per_token_ms, args.overhead_ms, args.plain_ms)
    if args.curve:
        costs.curve = [float(v) for v in args.curve.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    top = max(ks)
    policies: dict[str, Callable[[], Policy]] = {f"k={k}": (lambda k=k: fixed(k)) for k in ks}
    policies[f"by position <={top}"] = lambda: by_position(top, args.overhead_ms, args.plain_ms)
    policies[f"by match <={top}"] = lambda: by_match(top, args.overhead_ms, args.plain_ms)
    speedups: dict[str, dict[str, list[float]]] = {}
    wanted = {w for w in args.workloads.split(",") if w}
    for workload, prompt, output in load_texts(args.results):
        if wanted and workload not in wanted:
            continue
        plain = len(output) * costs.round_ms(0)
        for name, make in policies.items():
            ms = replay(prompt, output, make(), costs, args.ngram_min, args.ngram_max)
            speedups.setdefault(workload, {}).setdefault(name, []).append(plain / ms)
    names = list(policies)
    print("speedup over target-only (and / best fixed k), replayed:\n")
    print("| workload | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 1))
    means: dict[str, list[float]] = {n: [] for n in names}
    for workload, by_name in speedups.items():
        values = {n: statistics.mean(v) for n, v in by_name.items()}
        best = max(values[f"k={k}"] for k in ks)
        print(f"| {workload} | " + " | ".join(f"{values[n]:.3f} ({values[n] / best:.2f})" for n in names) + " |")
        for n in names:
            means[n].append(values[n])
    print("| mean | " + " | ".join(f"{statistics.mean(means[n]):.3f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
