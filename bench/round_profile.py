"""`python -m bench.round_profile`: where the time of a speculative round goes, in microseconds per round.

The harnesses report a round's overhead as one number (round time minus draft and verify compute). This tool splits
it. It starts a co-located gateway (target and draft in one process, synthetic acceptance as in
`bench.synthetic_target`) with timing probes wrapped around the services' layers, drives greedy requests at each k,
and prints per round: the gateway's own time, and for Propose and Verify the hand-off to and from the engine thread,
the step's Python, the Python around each llama_decode call, and the forward passes themselves.

    python -m bench.round_profile --target T.gguf --draft D.gguf --synth-len 2 --ks 2,4 --out DIR \
        [--target-flags "--n-gpu-layers -1 --device cuda:0"] [--draft-flags "..."] [--py-spy /path/to/py-spy]

The probes are wrappers installed only in the process this tool starts (`--serve`); nothing in the serving path
knows about them. Each costs ~1 us a call, which shows up in the figures it reports.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tandem.launch import settings_from_flags, start_colocated_gateway

STATS_ENV = "TANDEM_ROUND_PROFILE_OUT"


# --------------------------------------------------------------------------------------------- the probed process


def _install_probes(stats: dict[str, list[int]]) -> None:
    """Wrap the layers of a round with timers that add (calls, ns) to `stats`."""
    import services.draft.servicer as draft_servicer
    import services.target.servicer as target_servicer
    from services.draft.drafters import ModelDrafter
    from services.draft.service import DraftService
    from services.target.verifier import Verifier
    from tandem.engine import Engine

    def add(label: str, ns: int) -> None:
        entry = stats[label]
        entry[0] += 1
        entry[1] += ns

    def timed(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        if asyncio_function(original):

            @functools.wraps(original)
            async def wrapper(*args, **kwargs):
                t0 = time.perf_counter_ns()
                try:
                    return await original(*args, **kwargs)
                finally:
                    add(label, time.perf_counter_ns() - t0)
        else:

            @functools.wraps(original)
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter_ns()
                try:
                    return original(*args, **kwargs)
                finally:
                    add(label, time.perf_counter_ns() - t0)

        setattr(owner, name, wrapper)

    in_step = {"verify": False, "propose": False}

    def step(owner: Any, name: str, role: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            in_step[role] = True
            try:
                return original(*args, **kwargs)
            finally:
                in_step[role] = False

        setattr(owner, name, wrapper)

    step(Verifier, "verify_groups", "verify")
    step(DraftService, "propose_groups", "propose")
    timed(target_servicer.TargetServicer, "Verify", "verify.handler")
    timed(Verifier, "verify_groups", "verify.step")
    timed(Verifier, "_accept", "verify.accept")
    timed(draft_servicer.DraftServicer, "Propose", "propose.handler")
    timed(DraftService, "propose_groups", "propose.step")
    timed(ModelDrafter, "_catch_up", "propose.catch_up")
    decode = Engine.decode

    @functools.wraps(decode)
    def probed_decode(self: Engine, *args, **kwargs):
        f0, t0 = self.forward_ns, time.perf_counter_ns()
        try:
            return decode(self, *args, **kwargs)
        finally:
            # Prefill (Open) is not part of a round: count only the decodes of Propose and Verify steps.
            role = "verify" if id(self) in target_engines else "propose"
            if in_step[role]:
                add(f"{role}.decode", time.perf_counter_ns() - t0)
                add(f"{role}.forward", self.forward_ns - f0)

    Engine.decode = probed_decode
    target_engines: set[int] = set()
    verifier_init = Verifier.__init__

    @functools.wraps(verifier_init)
    def remember_target(self: Verifier, *args, **kwargs) -> None:
        verifier_init(self, *args, **kwargs)
        target_engines.add(id(self.engine))

    Verifier.__init__ = remember_target
    _probe_handoffs(add)


def _probe_handoffs(add) -> None:
    """Time the two thread hops of a call: submission -> the engine thread starts its step ("queue"), and results
    posted -> delivered on the event loop ("wake"); plus the scheduler's work around the step function."""
    from tandem import scheduler

    created: dict[int, int] = {}
    posted: dict[int, int] = {}

    class StampedSubmission(scheduler._Submission):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            created[id(self.future)] = time.perf_counter_ns()

    scheduler._Submission = StampedSubmission
    batch_step = scheduler.StepScheduler._batch_step

    def probed_batch_step(self, kind) -> None:
        now = time.perf_counter_ns()
        for sub in list(kind.pending):
            t = created.pop(id(sub.future), None)
            if t is not None:
                add("handoff.queue", now - t)
        batch_step(self, kind)
        add("handoff.batch_step", time.perf_counter_ns() - now)

    scheduler.StepScheduler._batch_step = probed_batch_step
    inline_step = scheduler.StepScheduler._inline_step

    def counted_inline_step(self, kind, items):
        add("handoff.inline_step", 0)  # counted only: these steps run outside the engine thread's loop
        return inline_step(self, kind, items)

    scheduler.StepScheduler._inline_step = counted_inline_step
    post = scheduler.StepScheduler._post

    def probed_post(results) -> None:
        now = time.perf_counter_ns()
        for _, future, _, _ in results:
            posted[id(future)] = now
        post(results)

    scheduler.StepScheduler._post = staticmethod(probed_post)
    deliver = scheduler._deliver

    def probed_deliver(batch) -> None:
        now = time.perf_counter_ns()
        for future, _, _ in batch:
            t = posted.pop(id(future), None)
            if t is not None:
                add("handoff.wake", now - t)
        deliver(batch)

    scheduler._deliver = probed_deliver


def asyncio_function(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def serve(argv: list[str]) -> None:
    """The co-located gateway (bench.synthetic_target --colocated-gateway) with probes; stats go to $STATS_ENV."""
    import llama_cpp  # noqa: F401 - before numpy, as tandem.engine does (numpy first can crash model loading)

    stats: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    _install_probes(stats)
    out = Path(os.environ[STATS_ENV])

    def dump_forever() -> None:
        while True:
            time.sleep(0.25)
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps({k: list(v) for k, v in list(stats.items())}))
            tmp.replace(out)

    threading.Thread(target=dump_forever, daemon=True, name="round-profile").start()
    from bench.synthetic_target import main

    main(argv)


# --------------------------------------------------------------------------------------------- the driver


def _read(path: Path) -> dict[str, list[int]]:
    return json.loads(path.read_text()) if path.exists() else {}


def round_seconds_sum(client: httpx.Client, address: str) -> float:
    """The gateway's `tandem_round_seconds_sum`: wall time inside its rounds (propose to verified), summed."""
    text = client.get(f"{address}/metrics").text
    match = re.search(r"^tandem_round_seconds_sum(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def split_round(before: dict, after: dict, replies: list[dict], in_rounds_s: float | None = None) -> dict[str, float]:
    """Microseconds per round (Verify call) of each layer, from the probe counters and the replies' timings."""

    def total(label: str) -> float:
        return (after.get(label, [0, 0])[1] - before.get(label, [0, 0])[1]) / 1e3

    def calls(label: str) -> int:
        return after.get(label, [0, 0])[0] - before.get(label, [0, 0])[0]

    rounds = max(calls("verify.handler"), 1)
    round_us = sum(r["timings"]["predicted_ms"] for r in replies) * 1e3 / rounds
    row = {"rounds": rounds, "round_us": round_us}
    for role in ("propose", "verify"):
        handler, step = total(f"{role}.handler"), total(f"{role}.step")
        decode, forward = total(f"{role}.decode"), total(f"{role}.forward")
        row |= {
            f"{role}_decodes": calls(f"{role}.decode") / rounds,
            f"{role}_forward_us": forward / rounds,
            f"{role}_handoff_us": (handler - step) / rounds,  # to the engine thread and back, plus protobuf
            f"{role}_step_py_us": (step - decode) / rounds,  # the step's own Python (checks, acceptance, drafting)
            f"{role}_decode_py_us": (decode - forward) / rounds,  # batch set-up and logits around llama_decode
        }
    row["accept_us"] = total("verify.accept") / rounds
    # Per call (two a round): the hop to the engine thread, the scheduler's work around the step function, and the
    # hop back to the event loop. The rest of a hand-off is the servicer's protobuf in and out.
    n_calls = max(calls("handoff.queue"), 1)
    row["hop_to_engine_us"] = total("handoff.queue") / n_calls
    row["hop_to_loop_us"] = total("handoff.wake") / max(calls("handoff.wake"), 1)
    # Steps on the engine thread only (inline steps have no scheduler loop around them). The step totals mix both
    # kinds, so with inline steps in the window the engine thread's share cannot be told apart: reported as "-"
    # (earlier versions printed a large negative number there).
    steps = calls("handoff.batch_step")
    if calls("handoff.inline_step"):
        row["scheduler_py_us"] = "-"
    else:
        threaded_step_us = total("handoff.batch_step") - total("propose.step") - total("verify.step") if steps else 0.0
        row["scheduler_py_us"] = threaded_step_us / steps if steps else 0.0
    row["gateway_us"] = round_us - (total("propose.handler") + total("verify.handler")) / rounds
    if in_rounds_s is not None:
        # Decode time outside the round loop's timed span: handing the round's tokens to the response, choosing
        # k, and the first token's hand-off. Part of gateway_us.
        row["between_rounds_us"] = round_us - in_rounds_s * 1e6 / rounds
    compute = row["propose_forward_us"] + row["verify_forward_us"]
    row["overhead_us"] = round_us - compute
    row["overhead_pct"] = 100 * row["overhead_us"] / round_us if round_us else 0.0
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}


def py_spy_summary(raw: Path, top: int = 25) -> list[tuple[int, str]]:
    """The source lines most often on top of a stack that holds the GIL, from py-spy's raw (collapsed) output."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack:
            counts[stack.split(";")[-1]] += int(n)
    return [(n, frame) for frame, n in counts.most_common(top)]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--serve" in argv:  # the gateway this tool starts (start_gateway puts its own flags first)
        serve([a for a in argv if a != "--serve"])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target-flags", default="--max-sessions 2 --n-ctx 4096")
    parser.add_argument("--draft-flags", default="--max-sessions 2 --n-ctx 4096")
    parser.add_argument("--synth-len", type=float, default=2.0)
    parser.add_argument("--ks", default="2,4")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--overlap", choices=("on", "off"), default="off")
    parser.add_argument("--py-spy", default=None, help="py-spy binary: also sample the gateway (GIL holders)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stats_path = (args.out / "probes.json").resolve()
    stats_path.unlink(missing_ok=True)
    target = settings_from_flags([*shlex.split(args.target_flags), "--no-prefix-cache"]) | {"model": args.target}
    draft = settings_from_flags([*shlex.split(args.draft_flags), "--no-prefix-cache"])
    draft |= {"drafter": "model", "model": args.draft}
    os.environ[STATS_ENV] = str(stats_path)
    print(f"round_profile: loading the co-located gateway ({Path(args.target).name} + {Path(args.draft).name})",
          file=sys.stderr, flush=True)  # fmt: skip
    gateway = start_colocated_gateway(
        args.out, target, draft, "--serve", "--synth-len", str(args.synth_len), "--colocated-gateway",
        f"--{'' if args.overlap == 'on' else 'no-'}overlap-draft", timeout=900, module="bench.round_profile",
    )  # fmt: skip
    rows = []
    try:
        client = httpx.Client(timeout=600)
        body = {"prompt": "Once upon a time", "temperature": 0, "cache_prompt": False}
        client.post(f"{gateway.address}/v1/completions", json=body | {"max_tokens": 8}).raise_for_status()
        for i, k in enumerate(int(x) for x in args.ks.split(",")):
            spy = None
            if args.py_spy and i == 0:
                spy = subprocess.Popen(
                    [args.py_spy, "record", "-p", str(gateway.pid), "-r", "1000", "-f", "raw", "--gil", "--threads",
                     "-o", str(args.out / "py-spy.txt")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
            time.sleep(0.6)
            before = _read(stats_path)
            rounds_before = round_seconds_sum(client, gateway.address)
            spec = {
                "max_tokens": args.max_tokens,
                "timings_detail": True,
                "speculative.n_max": k,
                "speculative.adaptive": False,
            }
            replies = []
            for _ in range(args.requests):
                reply = client.post(f"{gateway.address}/v1/completions", json=body | spec)
                reply.raise_for_status()
                replies.append(reply.json())
            time.sleep(0.6)
            after = _read(stats_path)
            in_rounds = round_seconds_sum(client, gateway.address) - rounds_before
            if spy is not None:
                spy.send_signal(2)
                spy.wait(30)
            row = {
                "k": k,
                "L": args.synth_len,
                "tok_s": round(sorted(r["timings"]["predicted_per_second"] for r in replies)[len(replies) // 2], 1),
            }
            rows.append(row | split_round(before, after, replies, in_rounds))
            print(f"round_profile: k={k}: {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        gateway.stop()
    keys = list(rows[0]) if rows else []
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    table += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    print("\n".join(table))
    (args.out / "round_profile.json").write_text(json.dumps(rows, indent=1))
    (args.out / "round_profile.md").write_text(
        f"`python -m bench.round_profile {shlex.join(argv)}`\n\n" + "\n".join(table) + "\n"
    )
    spy_raw = args.out / "py-spy.txt"
    if spy_raw.exists():
        lines = [f"{n:6d} {frame}" for n, frame in py_spy_summary(spy_raw)]
        (args.out / "py-spy-top.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines[:15]))


if __name__ == "__main__":
    main()
