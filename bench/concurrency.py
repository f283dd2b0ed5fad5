"""`python -m bench --concurrency 1,2,4,8,16`: aggregate tok/s with speculation on and off, by concurrent streams.

One stack as `make run` serves it (target, n-gram draft service, gateway with the default speculation), with the
gateway's `--max-concurrent` and the target's session slots raised to the largest concurrency. For each workload and
each concurrency c, c streams start together, each answering the workload's prompts in turn (shifted per stream),
first with speculation off (`"speculative.n_max": 0`) then on (the defaults), alternating which goes first per
repetition, after one untimed prefill of each of the level's prompts (`warm`); aggregate tok/s = completion tokens /
wall time of the c streams. With `--window-s W` each stream instead goes on through its prompts, round and round,
until W seconds have passed, and a request counts with the share of its tokens that falls inside the window (its
tokens taken as evenly spread over its time): every stream is busy for the whole window, so the tail where the
last streams finish alone, and how long that tail happens to be, no longer weighs on a cell; an untimed window comes
first in each cell (`cell_plan`). Each sample also
records the CPU seconds each process spent and the gateway's drafted and accepted tokens and target calls
(concurrency.json, `samples`). The goal (issue 42): on / off >= 1 at every concurrency. Writes concurrency.json,
concurrency.md and concurrency.png under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.harness import Stack
from bench.procstat import process_cpu_s
from bench.workloads import Workload, workloads
from tandem.launch import start_gateway, start_model_service

MODES = {"off": {"speculative.n_max": 0}, "on": {}}


def _request(client: httpx.Client, url: str, workload: Workload, prompt: str, max_tokens: int, mode: dict) -> int:
    """One chat completion; the completion tokens it received."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": workload.temperature,
        **({"seed": workload.seed} if workload.seed is not None else {}),
        **dict(workload.extra),
        **mode,
    }
    reply = client.post(f"{url}/v1/chat/completions", json=body)
    reply.raise_for_status()
    return reply.json()["usage"]["completion_tokens"]


def _stream(url: str, workload: Workload, prompts: list[str], max_tokens: int, mode: dict) -> int:
    """One stream: its prompts one after another; the completion tokens it received."""
    with httpx.Client(timeout=900) as client:
        return sum(_request(client, url, workload, prompt, max_tokens, mode) for prompt in prompts)


def plan_prompts(workload: Workload, streams: int, per_stream: int) -> list[list[str]]:
    """Each stream's prompts: the workload's, in turn, shifted by one per stream."""
    prompts = list(workload.prompts)
    return [[prompts[(s + i) % len(prompts)] for i in range(per_stream)] for s in range(streams)]


def warm(url: str, workload: Workload, streams: int, per_stream: int) -> None:
    """Prefill every prompt of the plan once, untimed (one token each), so that both modes find them in the prefix
    cache: otherwise the first measurement of each level pays every prefill, and with `off` first in the first
    repetition it ran 20-45% slower than the same mode measured last (2026-12-06), biasing on / off upwards."""
    distinct = list(dict.fromkeys(p for stream in plan_prompts(workload, streams, per_stream) for p in stream))
    _stream(url, workload, distinct, 1, MODES["off"])


def cell_plan(reps: int, window_s: float) -> list[tuple[str, bool]]:
    """The windows of one cell in order: (mode, recorded). Repetitions alternate which mode goes first (off, on; on,
    off; ...). With windows, an untimed window of speculation off comes first: the first window of a cell ran with
    every stream's prefill at once and session slots not yet holding the level's prompts, and being `off`, it alone
    paid for that. On one H200 (sessions 11-12, ten runs) the first `off` window of edits at 16 streams delivered 0.72
    of the cell's last (0.92-0.94 in the other cells), on the 2-core CPU 0.49-0.54 (20 s of prefill-sized calls
    against 2 s), and each cell's first repetition read on / off 1.23-1.64 where its second read 0.91-1.33: a bias
    for speculation, which `warm`'s one-at-a-time prefills did not remove. The untimed window is `off` so that the
    gateway's prices learn from steady windows as before: after an untimed `on` window (prefills of every stream at
    once on the 2-core CPU) no request drafted at all in the cells that followed (2026-12-07, session 12)."""
    plan = [("off", False)] if window_s > 0 else []
    for rep in range(reps):
        plan += [("off", True), ("on", True)] if rep % 2 == 0 else [("on", True), ("off", True)]
    return plan


def measure(
    url: str, workload: Workload, streams: int, per_stream: int, max_tokens: int, mode: dict, window_s: float = 0.0
) -> float:
    """Aggregate tok/s of `streams` concurrent streams: over all their requests, or over a window of `window_s`."""
    plan = plan_prompts(workload, streams, per_stream)
    if window_s > 0:
        return _windowed(url, workload, plan, max_tokens, mode, window_s)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=streams) as pool:
        tokens = sum(pool.map(lambda p: _stream(url, workload, p, max_tokens, mode), plan))
    return tokens / (time.perf_counter() - t0)


def _windowed(
    url: str, workload: Workload, plan: list[list[str]], max_tokens: int, mode: dict, window_s: float
) -> float:
    """Each stream sends its prompts in turn, again and again, until `window_s` has passed since the start; a request
    counts with the share of its tokens inside the window (`tokens_in_window`). (The sample's counters, from the
    gateway's metrics, also hold the requests' parts after the window: read them as ratios, not per token.)"""
    t0 = time.perf_counter()
    end = t0 + window_s

    def stream(prompts: list[str]) -> list[tuple[float, float, int]]:
        done = []
        with httpx.Client(timeout=900) as client:  # one connection a stream, as the whole-run mode has
            while time.perf_counter() < end:
                start = time.perf_counter()
                tokens = _request(client, url, workload, prompts[len(done) % len(prompts)], max_tokens, mode)
                done.append((start, time.perf_counter(), tokens))
        return done

    with ThreadPoolExecutor(max_workers=len(plan)) as pool:
        requests = [r for done in pool.map(stream, plan) for r in done]
    tokens = tokens_in_window(requests, t0, end)
    if tokens <= 0:
        raise RuntimeError(f"no token arrived inside a {window_s} s window: give --window-s more time")
    return tokens / window_s


def tokens_in_window(requests: list[tuple[float, float, int]], start: float, end: float) -> float:
    """Tokens of (start, end, tokens) requests that fall inside [start, end], each request's tokens taken as spread
    evenly over its own time."""
    total = 0.0
    for first, last, tokens in requests:
        inside = min(last, end) - max(first, start)
        if inside > 0:
            total += tokens * inside / (last - first)
    return total


# What each sample records besides tok/s (from the gateway's /metrics): where a mode's time went.
METRICS = {
    "drafted": "tandem_spec_decode_num_draft_tokens_total",
    "accepted": "tandem_spec_decode_num_accepted_tokens_total",
    "target_calls": 'tandem_upstream_calls_total{service="target"}',
    "draft_calls": 'tandem_upstream_calls_total{service="draft"}',
    # The target's forward passes and engine steps for those calls: forward time a step, on against off, says
    # whether a mode's loss is in the steps (on a GPU, steps whose size keeps changing: decision 0021) or around them.
    "target_forward_s": 'tandem_upstream_compute_seconds_total{service="target"}',
    "target_steps": "tandem_upstream_target_steps_total",
    # The target engine's llama_decode calls, and those whose batch layout changed from the call before (on CUDA they
    # run without a replayed graph): their share of the forward time is what changing step sizes cost.
    "decode_calls": 'tandem_engine_decode_calls{service="target"}',
    "decode_s": 'tandem_engine_decode_seconds{service="target"}',
    "reshaped_calls": 'tandem_engine_reshaped_calls{service="target"}',
    "reshaped_s": 'tandem_engine_reshaped_seconds{service="target"}',
}
ROUND_KINDS = 'tandem_round_kinds_total{kind="'
# The load governor's epochs, summed over load levels: in how many an "on" sample sent drafts and in how many it
# decoded plainly (the governor's verdict, or its exploration), so a lost cell shows which of the two it ran.
LOAD_EPOCHS = "tandem_load_epochs_total{"
# What the gateway priced rounds at when a sample ended (gauges, not counted over the sample): why drafts went out.
PRICE_ROUND = 'tandem_price_round_seconds{drafts="'
PRICE_PLAIN = "tandem_price_plain_token_seconds"


def snapshot(url: str, pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds of each process so far and the gateway's counters: on the 2-core CPU the gateway's Python competes
    with the target's forward passes, and CPU time shows it where tok/s swings with the host (decision 0018)."""
    out = {f"{name}_cpu_s": process_cpu_s(pid) for name, pid in pids.items()}
    return out | read_metrics(httpx.get(f"{url}/metrics", timeout=30).text)


def over_sample(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What a sample spent: each counter's growth over it, and the prices (gauges) as they stood at its end."""
    return {k: round(v, 3) if k.startswith("price_") else round(v - before.get(k, 0.0), 2) for k, v in after.items()}


def read_metrics(text: str) -> dict[str, float]:
    """The counters of `METRICS`, the round kinds, the governor's epochs and the prices (ms) from a gateway's /metrics
    text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        for key, metric in METRICS.items():
            if name == metric:
                out[key] = float(value)
        if name.startswith(ROUND_KINDS):  # how rounds were sent: a lone request's calls, on against off
            out["rounds_" + name[len(ROUND_KINDS) : -2]] = float(value)
        if name.startswith(PRICE_ROUND) and value != "NaN":
            out[f"price_round{name[len(PRICE_ROUND) : -2]}_ms"] = float(value) * 1e3
        if name == PRICE_PLAIN and value != "NaN":  # NaN: not measured yet
            out["price_plain_ms"] = float(value) * 1e3
        if name.startswith(LOAD_EPOCHS):
            key = "epochs_drafted" if 'drafts="yes"' in name else "epochs_plain"
            out[key] = out.get(key, 0.0) + float(value)
    return out


def main(args: argparse.Namespace) -> int:
    levels = [int(c) for c in args.concurrency.split(",")]
    loads = workloads(quick=False)
    wanted = set(args.workloads.split(",")) if args.workloads else {"edit", "chat", "json"}
    loads = [w for w in loads if w.name in wanted]
    out = args.out or Path("bench/results") / ("concurrency-" + time.strftime("%Y%m%d-%H%M%S"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    top = max(levels)
    stack = Stack()
    rows = []
    started = time.time()
    failure = None  # a sample that failed (a service died): the cells before it are still written
    cell: dict = {}  # the cell being measured, for the record of a failure
    try:
        print(f"starting the stack (slots and --max-concurrent {top}) ...", file=sys.stderr, flush=True)
        model = ["--model", args.model] if args.model else []
        target = start_model_service(
            "services.target",
            [*model, "--max-sessions", str(top), "--n-ctx", str(top * 4096), *shlex.split(args.target_args)],
            out / "logs",
        )
        stack.processes.append(target)
        draft = start_model_service("services.draft", ["--drafter", "ngram", "--max-sessions", str(top)], out / "logs")
        stack.processes.append(draft)
        gateway_args = ["--max-concurrent", str(top), *shlex.split(args.gateway_args)]
        gateway = start_gateway(target.address, draft.address, out / "logs", *gateway_args)
        stack.processes.append(gateway)
        pids = {"target": target.pid, "draft": draft.pid, "gateway": gateway.pid}
        measure(gateway.address, loads[0], 1, 1, 8, {})  # warm-up
        for workload in loads:
            for c in levels:
                samples: dict[str, list[float]] = {"off": [], "on": []}
                warm(gateway.address, workload, c, args.per_stream)
                details = []
                cell = {"workload": workload.name, "concurrency": c, "samples": details}
                for name, recorded in cell_plan(args.reps, args.window_s):
                    before = snapshot(gateway.address, pids) if recorded else {}
                    tok_s = measure(
                        gateway.address, workload, c, args.per_stream, args.max_tokens, MODES[name], args.window_s
                    )
                    if recorded:
                        spent = over_sample(before, snapshot(gateway.address, pids))
                        samples[name].append(tok_s)
                        details.append({"mode": name, "tok_s": round(tok_s, 1), **spent})
                        print(f"{workload.name} c={c} {name}: {tok_s:.1f} tok/s {spent}", file=sys.stderr, flush=True)
                    else:
                        print(f"{workload.name} c={c} {name} (untimed): {tok_s:.1f} tok/s", file=sys.stderr, flush=True)
                off, on = statistics.median(samples["off"]), statistics.median(samples["on"])
                row = {"workload": workload.name, "concurrency": c, "off_tok_s": round(off, 1)}
                # Each repetition's own on / off (measured back to back): their spread is the cell's noise.
                paired = [a / b for a, b in zip(samples["on"], samples["off"], strict=True) if b > 0]
                if paired:
                    row |= {"ratio_lo": round(min(paired), 3), "ratio_hi": round(max(paired), 3)}
                ratio = round(on / off, 3) if off > 0 else math.inf
                rows.append({**row, "on_tok_s": round(on, 1), "ratio": ratio, "samples": details})
                cell = {}
    except Exception as exc:  # a service died, or a sample measured nothing: keep what was measured
        failure = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        print(f"stopped: {failure} (the services' logs are in {out / 'logs'})", file=sys.stderr, flush=True)
    finally:
        stack.stop()
    meta = {
        "command": "python -m bench " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "seconds": round(time.time() - started, 1),
        **({"failure": failure, "failed_cell": cell} if failure else {}),
    }
    write(out, meta, rows)
    return 1 if failure else 0


def _on_off(row: dict, part: str, whole: str, shown: Callable[[float], str]) -> str:
    """'on / off' of sum(part) / sum(whole) over a cell's samples of each mode; '-' where `whole` is zero."""
    values = []
    for mode in ("on", "off"):
        samples = [s for s in row["samples"] if s["mode"] == mode]
        total = sum(s.get(whole, 0.0) for s in samples)
        values.append(shown(sum(s.get(part, 0.0) for s in samples) / total) if total > 0 else "-")
    return " / ".join(values)


def _step_ms(row: dict) -> str:
    """Forward ms a target step, each step weighted by the calls it served (both counters are summed per request)."""
    return _on_off(row, "target_forward_s", "target_steps", lambda v: f"{1e3 * v:.2f}")


def _reshaped(row: dict) -> str:
    """The share of the target's forward time in calls whose layout changed."""
    return _on_off(row, "reshaped_s", "decode_s", lambda v: f"{100 * v:.0f}%")


def _spread(row: dict) -> str:
    """', lo-hi' of the cell's per-repetition ratios (none for one repetition or rows of an older run)."""
    lo, hi = row.get("ratio_lo"), row.get("ratio_hi")
    if lo is None or hi is None or f"{lo:.2f}" == f"{hi:.2f}":
        return ""
    return f", {lo:.2f}-{hi:.2f}"


def write(out: Path, meta: dict, rows: list[dict]) -> None:
    (out / "concurrency.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    levels = sorted({r["concurrency"] for r in rows})
    names = list(dict.fromkeys(r["workload"] for r in rows))
    cell = {(r["workload"], r["concurrency"]): r for r in rows}
    lines = [
        "# Speculation under load: aggregate tok/s, on / off",
        "",
        f"{meta['date']} · `{meta['command']}` · {meta['seconds']} s",
        "",
        *(
            [f"**Stopped early** by a failed sample ({meta['failure']}): the cells below are those before it.", ""]
            if meta.get("failure")
            else []
        ),
        "| workload | " + " | ".join(f"{c} stream{'s' if c > 1 else ''}" for c in levels) + " |",
        "|---|" + "---|" * len(levels),
    ]
    for name in names:
        parts = []
        for c in levels:
            r = cell.get((name, c))
            parts.append(f"{r['on_tok_s']} / {r['off_tok_s']} (**{r['ratio']:.2f}**{_spread(r)})" if r else "-")
        lines.append(f"| {name} | " + " | ".join(parts) + " |")
    if any(_spread(r) for r in rows):
        lines += ["", "After the ratio: the lowest and highest on / off of one repetition (its two samples measured"]
        lines += ["back to back); a range across 1 says the cell's noise is larger than its difference."]
    for title, shown in (
        ("The target's forward time per engine step, ms, on / off (all samples of a cell):", _step_ms),
        (
            "Share of the target's forward time in calls whose batch layout changed from the call before, on / off:",
            _reshaped,
        ),
    ):
        lines += ["", title, "", "| workload | " + " | ".join(str(c) for c in levels) + " |"]
        lines.append("|---|" + "---|" * len(levels))
        for name in names:
            parts = [shown(cell[(name, c)]) if (name, c) in cell else "-" for c in levels]
            lines.append(f"| {name} | " + " | ".join(parts) + " |")
    (out / "concurrency.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        xs = [c for c in levels if (name, c) in cell]
        ax.plot(xs, [cell[(name, c)]["ratio"] for c in xs], marker="o", label=name)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate tok/s, speculation on / off")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "concurrency.png", dpi=120)
    plt.close(fig)
