"""`python -m bench.features`: each speed feature measured on and off, side by side in one run.

- continuous batching: aggregate decode rate of 8 concurrent streams against one stream at a time, with the
  services merging calls into one engine step (default) and with `--max-batch 1`; every temperature-0 text under
  load is compared with its single-request answer;
- prefix reuse: time to first token of a chat's second turn after a ~1,000-token first turn, with the prefix cache
  (default) and without, and of the cold first turn;
- TTFT with speculation on against target-only on the same long prompts (draft and target prefill concurrently);
- overlapped drafting: a model draft and the target on one core each (two devices in miniature), with the draft
  drafting the next round during verification (default) and without;
- pipelined lookup rounds (`--sections pipeline`, not in the default set): the gateway's prompt lookup sending its
  rounds without a draft ahead (default) and one call at a time, against target-only decoding, on every workload.
Adaptive draft length is measured by the main harness (`python -m bench`, rows "adaptive").

Every section starts its stacks, measures them interleaved, and stops them; results go to a Markdown table on
stdout and JSON (+ a PNG) under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.workloads import workloads
from tandem.launch import Process, start_gateway, start_model_service

PROMPTS_PER_STREAM = 8
#: Batching is about decode: short prompts, so that prefill (which batching does not speed up) stays a small share.
SHORT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator works to a ten-year-old.",
    "Describe a busy morning at a fish market in a small harbour town.",
    "What are the pros and cons of working from home? Answer in prose.",
    "Write a letter from a cat to its owner about the new dog.",
    "Explain why the sky is blue and sunsets are red.",
    "Tell the story of a chess game between two old friends in a park.",
    "Describe how bread is made, from wheat field to bakery shelf.",
]


def log(message: str) -> None:
    print(f"features: {message}", file=sys.stderr, flush=True)


class Stacks:
    """Processes started by this run, stopped in reverse order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Process] = []

    def service(self, module: str, args: list[str], cpus: set[int] | None = None) -> Process:
        proc = start_model_service(module, args, self.log_dir, cpus=cpus)
        self.procs.append(proc)
        return proc

    def gateway(self, target: Process, draft: Process | None, *extra: str) -> str:
        proc = start_gateway(target.address, draft.address if draft else None, self.log_dir, *extra)
        self.procs.append(proc)
        return proc.address

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()


#: Send plain completions instead of chat (models without a chat template, e.g. bench/random_gguf.py's).
RAW_PROMPTS = False


async def chat(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int, **extra) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "timings_detail": True, "temperature": 0, **extra}
    endpoint = "chat/completions"
    if RAW_PROMPTS:
        body["prompt"] = "\n\n".join(m["content"] for m in body.pop("messages"))
        endpoint = "completions"
    t0 = time.perf_counter()
    response = await client.post(f"{url}/v1/{endpoint}", json=body, timeout=900)
    response.raise_for_status()
    data = response.json()
    data["wall_s"] = time.perf_counter() - t0
    return data


def text_of(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


# ------------------------------------------------------------------------------------------------ batching


def ngram_stack(stacks: Stacks, threads: str, extra: list[str], target_args: list[str] | None = None) -> str:
    """Target + n-gram draft + gateway sized for 8 concurrent streams; returns the gateway URL."""
    common = ["--no-prefix-cache", "--max-sessions", "16", "--n-ctx", "32768", *extra]
    target = stacks.service("services.target", ["--n-threads", threads, *common, *(target_args or [])])
    draft = stacks.service("services.draft", ["--drafter", "ngram", *common])
    return stacks.gateway(target, draft, "--max-concurrent", "16")


async def streams_of(
    client: httpx.AsyncClient, url: str, prompts: list[str], max_tokens: int, spec: dict, concurrent: bool
) -> tuple[list[dict], float]:
    """One chat request per prompt, one after another or all at once; the replies and the wall time."""
    t0 = time.perf_counter()
    calls = (chat(client, url, [{"role": "user", "content": p}], max_tokens, **spec) for p in prompts)
    replies = list(await asyncio.gather(*calls)) if concurrent else [await call for call in calls]
    return replies, time.perf_counter() - t0


async def batching(
    stacks: Stacks, threads: str, max_tokens: int, rounds: int, target_args: list[str] | None = None
) -> list[dict]:
    """Aggregate tok/s at concurrency 1 and 8, batching on and off, target-only and n-gram speculation.

    `target_args` places the target elsewhere (e.g. `--model X --n-gpu-layers -1 --device cuda:0`).
    """
    prompts = SHORT_PROMPTS[:PROMPTS_PER_STREAM]
    urls = {}
    for name, extra in (("on", []), ("off", ["--max-batch", "1"])):
        log(f"starting the batching-{name} stack ...")
        urls[name] = ngram_stack(stacks, threads, extra, target_args)
    rows = []
    async with httpx.AsyncClient() as client:
        for mode, spec in (
            ("target-only", {"speculative.n_max": 0}),
            ("n-gram adaptive k<=4", {"speculative.n_max": 4}),  # adaptive k is the default policy
        ):
            samples: dict[tuple[str, int], list[float]] = {}
            same: dict[str, list[bool]] = {"on": [], "off": []}
            for r in range(rounds):
                for name, url in urls.items() if r % 2 == 0 else reversed(urls.items()):
                    log(f"batching {mode}, stack {name}, round {r + 1}: 1 stream ...")
                    alone, wall1 = await streams_of(client, url, prompts, max_tokens, spec, concurrent=False)
                    log(f"batching {mode}, stack {name}, round {r + 1}: {len(prompts)} streams ...")
                    together, wall8 = await streams_of(client, url, prompts, max_tokens, spec, concurrent=True)
                    tokens1 = sum(a["usage"]["completion_tokens"] for a in alone)
                    tokens8 = sum(a["usage"]["completion_tokens"] for a in together)
                    samples.setdefault((name, 1), []).append(tokens1 / wall1)
                    samples.setdefault((name, 8), []).append(tokens8 / wall8)
                    same[name] += [text_of(a) == text_of(b) for a, b in zip(alone, together, strict=True)]
            for name in urls:
                one = statistics.median(samples[(name, 1)])
                eight = statistics.median(samples[(name, 8)])
                rows.append(
                    {
                        "section": "batching",
                        "mode": mode,
                        "setting": f"batching {name}",
                        "tok_s_1_stream": round(one, 1),
                        "tok_s_8_streams": round(eight, 1),
                        "ratio": round(eight / one, 2),
                        "same_text": f"{sum(same[name])}/{len(same[name])}",
                    }
                )
    stacks.stop()
    return rows


async def load_adaptation(stacks: Stacks, threads: str, max_tokens: int, rounds: int) -> list[dict]:
    """Adaptive k under load: draft length chosen and aggregate tok/s, 1 stream vs 8, against a fixed k=8.

    Under load the target's step is shared, so an extra draft token costs every session in the step; the adaptive
    policy should then draft less. The n-gram drafter, batching on.
    """
    prompts = SHORT_PROMPTS[:PROMPTS_PER_STREAM]
    log("starting the load-adaptation stack ...")
    url = ngram_stack(stacks, threads, [])
    # Adaptive k is on by default: the fixed row must turn it off, or both rows measure the same policy.
    modes = (("fixed k=8", {"speculative.n_max": 8, "speculative.adaptive": False}), ("adaptive k<=8",
             {"speculative.n_max": 8, "speculative.adaptive": True}))  # fmt: skip
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    async with httpx.AsyncClient() as client:
        for r in range(rounds):
            for name, spec in modes if r % 2 == 0 else reversed(modes):
                for streams in (1, 8):
                    log(f"load adaptation {name}, {streams} stream(s), round {r + 1} ...")
                    replies, wall = await streams_of(client, url, prompts, max_tokens, spec, concurrent=streams > 1)
                    tokens = sum(a["usage"]["completion_tokens"] for a in replies)
                    lengths = [a["timings"].get("draft_length_mean") for a in replies]
                    lengths = [x for x in lengths if x is not None]
                    mean_k = statistics.mean(lengths) if lengths else 0.0
                    samples.setdefault((name, streams), []).append((tokens / wall, mean_k))
    stacks.stop()
    rows = []
    for (name, streams), values in samples.items():
        rows.append(
            {
                "section": "load",
                "mode": name,
                "streams": streams,
                "tok_s": round(statistics.median(v[0] for v in values), 1),
                "draft_length_asked": round(statistics.mean(v[1] for v in values), 2),
            }
        )
    return rows


# ------------------------------------------------------------------------------------------------ prefix reuse


def long_history(seed: int, words: int = 700) -> str:
    """A ~1,000-token document that no earlier request shares (so the first turn is cold)."""
    vocab = [
        "river",
        "stone",
        "lantern",
        "harbour",
        "meadow",
        "copper",
        "violet",
        "orchard",
        "signal",
        "ember",
        "canyon",
        "thimble",
        "glacier",
        "saddle",
        "quartz",
        "marble",
        "willow",
        "beacon",
        "hollow",
        "cedar",
    ]
    out, x = [], seed * 7919 + 17
    for i in range(words):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(vocab[x % len(vocab)] + ("." if i % 12 == 11 else ""))
    return f"Notes #{seed}: " + " ".join(out)


async def prefix(stacks: Stacks, threads: str, reps: int, words: int = 700, target_args: list[str] = ()) -> list[dict]:
    """TTFT of the second turn of a chat after a long first turn (700 words: ~1,000 tokens on SmolLM2; `--prefix-words
    3000` for ~4k), prefix cache on and off, and turn 2's TTFT as a share of turn 1's."""
    urls = {}
    for name, extra in (("on", []), ("off", ["--no-prefix-cache"])):
        log(f"starting the prefix-{name} stack ...")
        target = stacks.service("services.target", ["--n-threads", threads, *extra, *target_args])
        draft = stacks.service("services.draft", ["--drafter", "ngram"])
        urls[name] = stacks.gateway(target, draft)
    ttft: dict[str, list[float]] = {}
    async with httpx.AsyncClient() as client:
        for rep in range(reps):
            for name, url in urls.items():
                notes = long_history(rep * 10 + (name == "off"), words)
                history = [{"role": "user", "content": notes + "\nSummarise."}]
                first = await chat(client, url, history, 24)
                ttft.setdefault(f"turn 1 (cold), cache {name}", []).append(first["timings"]["prompt_ms"])
                turn2 = [*history, {"role": "assistant", "content": text_of(first)},
                         {"role": "user", "content": "Now list three words from the notes."}]  # fmt: skip
                second = await chat(client, url, turn2, 24)
                ttft.setdefault(f"turn 2, cache {name}", []).append(second["timings"]["prompt_ms"])
                prompt_n = second["timings"]["prompt_n"]
                log(f"prefix rep {rep + 1}, cache {name}: turn-2 prompt {prompt_n} tokens, TTFT "
                    f"{first['timings']['prompt_ms']:.0f} -> {second['timings']['prompt_ms']:.0f} ms")  # fmt: skip
    stacks.stop()
    cold = statistics.median(ttft["turn 2, cache off"])
    turn1 = statistics.median(ttft["turn 1 (cold), cache on"])
    return [
        {"section": "prefix", "setting": key, "ttft_ms": round(statistics.median(v), 1),
         "vs_turn2_cold": round(statistics.median(v) / cold, 3), "vs_turn1": round(statistics.median(v) / turn1, 3),
         "prompt_tokens": prompt_n}
        for key, v in ttft.items()
    ]  # fmt: skip


# ------------------------------------------------------------------------------------------------ TTFT with speculation


async def ttft_speculation(stacks: Stacks, reps: int) -> list[dict]:
    """TTFT with speculation (n-gram and model drafts) against target-only, same stack, cold ~1,000-token prompts."""
    log("starting the TTFT stack (target and model draft on a core each, as on two devices) ...")
    cores = sorted(os.sched_getaffinity(0))
    one, other = ({cores[0]}, {cores[1]}) if len(cores) > 1 else (None, None)
    target = stacks.service("services.target", ["--n-threads", "1", "--no-prefix-cache"], cpus=one)
    ngram = stacks.service("services.draft", ["--drafter", "ngram"])
    model = stacks.service(
        "services.draft", ["--drafter", "model", "--n-threads", "1", "--no-prefix-cache"], cpus=other
    )
    urls = {"n-gram draft": stacks.gateway(target, ngram), "model draft": stacks.gateway(target, model)}
    samples: dict[str, list[float]] = {}
    async with httpx.AsyncClient() as client:
        for rep in range(reps):
            messages = [{"role": "user", "content": long_history(1000 + rep) + "\nSummarise."}]
            for name, url in urls.items():
                for label, spec in (("target-only", {"speculative.n_max": 0}), ("speculative", {})):
                    reply = await chat(client, url, messages, 4, **spec)
                    samples.setdefault(f"{name}: {label}", []).append(reply["timings"]["prompt_ms"])
    stacks.stop()
    rows = []
    for name in urls:
        plain = statistics.median(samples[f"{name}: target-only"])
        spec = statistics.median(samples[f"{name}: speculative"])
        rows.append({"section": "ttft", "setting": name, "ttft_target_only_ms": round(plain, 1),
                     "ttft_speculative_ms": round(spec, 1), "ratio": round(spec / plain, 3)})  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------------ overlapped drafting


async def overlap(stacks: Stacks, max_tokens: int, reps: int) -> list[dict]:
    """A same-size model draft on core 1 and the target on core 0; draft-ahead on and off; k fixed and adaptive."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        log("overlap: needs two cores, skipped")
        return []
    log("starting the overlap stack (target on one core, draft on another) ...")
    target = stacks.service("services.target", ["--n-threads", "1", "--no-prefix-cache"], cpus={cores[0]})
    draft = stacks.service(
        "services.draft", ["--drafter", "model", "--n-threads", "1", "--no-prefix-cache"], cpus={cores[1]}
    )
    urls = {"on": stacks.gateway(target, draft, "--overlap-draft"), "off": stacks.gateway(target, draft)}
    loads = [w for w in workloads(quick=True) if w.name in ("edit", "chat", "summary")]
    samples: dict[tuple, list[dict]] = {}
    async with httpx.AsyncClient() as client:
        for rep in range(reps):
            for w in loads:
                for spec_name, spec in (("k=4", {"speculative.n_max": 4, "speculative.adaptive": False}),
                                        ("target-only", {"speculative.n_max": 0})):  # fmt: skip
                    order = list(urls.items()) if rep % 2 == 0 else list(reversed(urls.items()))
                    for name, url in order:
                        if spec_name == "target-only" and name == "off":
                            continue
                        reply = await chat(client, url, [{"role": "user", "content": w.prompts[0]}], max_tokens, **spec)
                        samples.setdefault((w.name, spec_name, name), []).append(reply)
                        log(
                            f"overlap {w.name} {spec_name} {name}: {reply['timings']['predicted_per_second']:.1f} tok/s"
                        )
    stacks.stop()
    rows = []
    for w in loads:
        base = statistics.median(r["timings"]["predicted_per_second"] for r in samples[(w.name, "target-only", "on")])
        for name in urls:
            replies = samples[(w.name, "k=4", name)]
            tok_s = statistics.median(r["timings"]["predicted_per_second"] for r in replies)
            rows.append(
                {
                    "section": "overlap",
                    "workload": w.name,
                    "setting": f"draft-ahead {name}",
                    "tok_s": round(tok_s, 1),
                    "target_only_tok_s": round(base, 1),
                    "speedup": round(tok_s / base, 2),
                    "overlapped_rounds": sum(r["timings"].get("overlapped_rounds", 0) for r in replies),
                    "rounds": sum(r["timings"].get("rounds", 0) for r in replies),
                    "acceptance": round(statistics.median(r["timings"]["acceptance_rate"] or 0 for r in replies), 3),
                }
            )
    return rows


# ------------------------------------------------------------------------------------------------ pipelined lookup


async def pipeline(
    stacks: Stacks,
    threads: str,
    max_tokens: int,
    reps: int,
    target_args: list[str] | None = None,
    names: list[str] | None = None,
) -> list[dict]:
    """The gateway's prompt lookup with its rounds without a draft pipelined (default) and one call at a time
    (`--plain-pipeline 1`), against target-only decoding, on the benchmark workloads (both prompts each, or those
    in `names`). `target_args` places the target elsewhere (a GPU)."""
    log("starting the pipeline stack (one target, two local n-gram gateways) ...")
    target = stacks.service("services.target", ["--n-threads", threads, "--no-prefix-cache", *(target_args or [])])
    urls = {"on": stacks.gateway(target, None, "--local-ngram"),
            "off": stacks.gateway(target, None, "--local-ngram", "--plain-pipeline", "1")}  # fmt: skip
    configs = [("target-only", "on", {"speculative.n_max": 0}), ("lookup, pipelined", "on", {}),
               ("lookup, one call at a time", "off", {})]  # fmt: skip
    samples: dict[tuple[str, int, str], list[dict]] = {}
    loads = [w for w in workloads(quick=False) if names is None or w.name in names]
    async with httpx.AsyncClient() as client:
        for rep in range(reps):
            for w in loads:
                sampling = {"temperature": w.temperature, **({"seed": w.seed} if w.seed is not None else {})}
                for i, prompt in enumerate(w.prompts):
                    shift = (rep + i) % len(configs)  # rotate the order, so drift hits every configuration
                    for name, gw, spec in configs[shift:] + configs[:shift]:
                        reply = await chat(
                            client, urls[gw], [{"role": "user", "content": prompt}], max_tokens, **sampling, **spec
                        )
                        samples.setdefault((w.name, i, name), []).append(reply)
                        t = reply["timings"]
                        log(f"pipeline {w.name} #{i} {name}: {t['predicted_per_second']:.1f} tok/s, "
                            f"{t.get('pipelined_rounds', 0)} pipelined of {t['verify_calls']} calls")  # fmt: skip
                log(f"pipeline: repetition {rep + 1} of {reps} done")
    stacks.stop()

    def rate(name: str, w, i: int) -> float:
        return statistics.median(r["timings"]["predicted_per_second"] for r in samples[(w.name, i, name)])

    rows = []
    for w in loads:
        n = len(w.prompts)
        base = [rate("target-only", w, i) for i in range(n)]
        for name, _, _ in configs:
            rates = [rate(name, w, i) for i in range(n)]
            ratios = [a / b for a, b in zip(rates, base, strict=True)]
            replies = [r for i in range(n) for r in samples[(w.name, i, name)]]
            rounds = sum(r["timings"]["verify_calls"] for r in replies)
            rows.append({"section": "pipeline", "workload": w.name, "setting": name,
                         "tok_s": round(statistics.geometric_mean(rates), 1),
                         "speedup": round(statistics.geometric_mean(ratios), 3),
                         "pipelined_share": round(sum(r["timings"].get("pipelined_rounds", 0) for r in replies)
                                                  / rounds, 3) if rounds else None,
                         "drafted_rounds_share": round(sum(r["timings"]["rounds"] for r in replies) / rounds, 3)
                         if rounds else None})  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------------ report


def table(rows: list[dict]) -> str:
    out = []
    for section in dict.fromkeys(r["section"] for r in rows):
        part = [r for r in rows if r["section"] == section]
        keys = [k for k in part[0] if k != "section"]
        out.append(f"\n### {section}\n")
        out.append("| " + " | ".join(keys) + " |")
        out.append("|" + "---|" * len(keys))
        out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in part]
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for r in rows:
        if r["section"] == "batching":
            labels.append(f"{r['mode']}\n{r['setting']}")
            values.append(r["ratio"])
        elif r["section"] == "overlap":
            labels.append(f"overlap {r['workload']}\n{r['setting']}")
            values.append(r["speedup"])
        elif r["section"] == "pipeline":
            labels.append(f"{r['workload']}\n{r['setting']}")
            values.append(r["speedup"])
        elif r["section"] == "prefix":
            labels.append(r["setting"].replace(", ", "\n"))
            values.append(r["vs_turn2_cold"])
    if not values:
        return
    fig, ax = plt.subplots(figsize=(max(6, len(values) * 1.1), 4))
    ax.bar(range(len(values)), values, color="#4477aa")
    ax.set_xticks(range(len(values)), labels, fontsize=7, rotation=30, ha="right")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("ratio (see table)")
    ax.set_title("tandem features, on vs off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="batching,prefix,ttft,overlap")
    parser.add_argument("--threads", default="2", help="target threads (batching, prefix, ttft sections)")
    parser.add_argument("--raw-prompts", action="store_true", help="plain completions (models without a template)")
    parser.add_argument(
        "--target-args", default="", help="batching, prefix and pipeline sections: extra target flags (model, GPU)"
    )
    parser.add_argument("--prefix-words", type=int, default=700, help="prefix section: words of the first turn")
    parser.add_argument("--workloads", default="", help="pipeline section: comma-separated workload names")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or Path("bench/results") / ("features-" + time.strftime("%Y%m%d-%H%M%S"))
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    stacks = Stacks(log_dir)
    rows: list[dict] = []
    sections = args.sections.split(",")
    global RAW_PROMPTS
    RAW_PROMPTS = args.raw_prompts
    try:
        if "batching" in sections:
            rows += asyncio.run(
                batching(stacks, args.threads, args.max_tokens, args.reps, shlex.split(args.target_args))
            )
        if "load" in sections:
            rows += asyncio.run(load_adaptation(stacks, args.threads, args.max_tokens, args.reps))
        if "prefix" in sections:
            target_args = shlex.split(args.target_args)
            rows += asyncio.run(prefix(stacks, args.threads, args.reps + 1, args.prefix_words, target_args))
        if "ttft" in sections:
            rows += asyncio.run(ttft_speculation(stacks, args.reps + 1))
        if "overlap" in sections:
            rows += asyncio.run(overlap(stacks, args.max_tokens, args.reps))
        if "pipeline" in sections:
            names = args.workloads.split(",") if args.workloads else None
            target_args = shlex.split(args.target_args)
            rows += asyncio.run(pipeline(stacks, args.threads, args.max_tokens, args.reps, target_args, names))
    finally:
        stacks.stop()
    meta = {"command": " ".join(["python -m bench.features", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count()}  # fmt: skip
    (out / "features.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    report = f"# tandem features, on vs off ({meta['date']})\n\n`{meta['command']}`\n{table(rows)}\n"
    (out / "features.md").write_text(report)
    plot(rows, out / "features.png")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
