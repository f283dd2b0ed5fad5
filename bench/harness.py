"""`make bench`: tandem against target-only decoding (and optionally llama.cpp's llama-server), side by side.

Every configuration runs in the same process tree, interleaved: for each repetition, each workload prompt is sent to
every configuration in a rotating order, so machine noise hits them alike. A workload's tok/s is the geometric mean
over its prompts of each prompt's median over repetitions, and its speedup the geometric mean of the per-prompt ratios
(a plain median over prompts of very different speeds swung with one noisy request). Speedups are ratios within one
run. `--resummarise results.json` recomputes the tables of an earlier run from its records. Hardware specifics (GPU
layers, devices, threads) come from the command line, so the same harness runs unchanged on a GPU machine.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.workloads import Workload, workloads
from tandem.launch import (
    Process,
    free_port,
    settings_from_flags,
    start_colocated_gateway,
    start_gateway,
    start_model_service,
    wait_http_ok,
)

MAX_TOKENS = 256


@dataclass(frozen=True)
class Config:
    name: str
    family: str  # "tandem" or "llama-server"
    url: str
    n_max: int | None  # per-request "speculative.n_max"; None = the server's own setting
    baseline: str  # the configuration this one's speedup and text are compared with
    drafter: str = "none"
    adaptive: bool = False  # tandem: choose k per round in 1..n_max (adaptive draft length) instead of k = n_max
    ngram_min: int | None = None  # tandem's lookup in the gateway: shortest match that drafts (None: the default)


@dataclass
class Record:
    config: str
    workload: str
    prompt: int
    rep: int
    text: str
    timings: dict
    wall_s: float


@dataclass
class Peer:
    """A llama-server process and how it was started (to start it again on the same port)."""

    proc: subprocess.Popen
    cmd: list[str]
    log_path: Path
    url: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Stack:
    processes: list[Process] = field(default_factory=list)
    peers: list[Peer] = field(default_factory=list)

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.stop()
        for peer in self.peers:
            peer.stop()

    def restart_peers(self, urls: set[str]) -> None:
        """Start the llama-servers serving `urls` afresh, on the same ports: their state across requests (ngram-mod's
        n-gram pool, which drafts a repeated prompt's earlier answer) starts empty again."""
        for i, peer in enumerate(self.peers):
            if peer.url not in urls:
                continue
            peer.stop()
            self.peers[i] = _launch_peer(peer.cmd, peer.log_path, peer.url)


def start_tandem(
    args: argparse.Namespace, log_dir: Path, stack: Stack
) -> tuple[str, str, dict[str, str], str | None, str | None]:
    """Target, n-gram draft and (unless disabled) model draft, each with a gateway. Returns the gateway URLs:
    local n-gram, n-gram service, model drafts by placement, and with --one-token-calls one-token target-only calls
    and the n-gram service with a Propose every round."""
    model = ["--model", args.model] if args.model else []
    draft_model = ["--model", args.draft_model or args.model] if (args.draft_model or args.model) else []
    print("starting target ...", file=sys.stderr, flush=True)
    # No prefix cache: every configuration prefills every prompt cold, as llama-server does with cache_prompt off.
    target_args = ["--no-prefix-cache", *model, *shlex.split(args.target_args)]
    target = start_model_service("services.target", target_args, log_dir)
    stack.processes.append(target)
    # The n-gram drafter runs in the gateway (--local-ngram, no Propose RPC per round); one configuration keeps the
    # draft service, to show what the RPC costs.
    ngram_gw = start_gateway(target.address, None, log_dir, "--n-max", "4", "--local-ngram")
    stack.processes.append(ngram_gw)
    ngram = start_model_service("services.draft", ["--drafter", "ngram"], log_dir)
    stack.processes.append(ngram)
    service_gw = start_gateway(target.address, ngram.address, log_dir, "--n-max", "4")
    stack.processes.append(service_gw)
    model_urls: dict[str, str] = {}
    if not args.no_model_draft:
        for name, extra in placements(args):
            print(f"starting model draft ({name}) ...", file=sys.stderr, flush=True)
            flags = shlex.split(extra)  # may name its own drafter: --draft "chained=--drafter ngram,model"
            drafter = [] if "--drafter" in flags else ["--drafter", "model"]
            draft = start_model_service("services.draft", [*drafter, *draft_model, *flags], log_dir)
            stack.processes.append(draft)
            gateway = start_gateway(target.address, draft.address, log_dir, "--n-max", "4")
            stack.processes.append(gateway)
            model_urls[name] = gateway.address
    one_token = every_round = None
    if args.one_token_calls:
        gateway = start_gateway(target.address, None, log_dir, "--plain-burst-ms", "0", "--local-ngram")
        stack.processes.append(gateway)
        one_token = gateway.address
        # The n-gram service with a Propose and a one-token call every round without a draft (no stretches).
        gateway = start_gateway(target.address, ngram.address, log_dir, "--n-max", "4", "--plain-pipeline", "1")
        stack.processes.append(gateway)
        every_round = gateway.address
    return ngram_gw.address, service_gw.address, model_urls, one_token, every_round


COLOCATED = "co-located "  # name prefix of the configurations served by a gateway with the target in its process
ONE_TOKEN = "target-only 1-token calls"  # --one-token-calls: target-only, one token per Verify call
ONE_TOKEN_LOOKUP = "1-token calls"  # --one-token-calls: the adaptive lookup with one plain token per Verify call
EVERY_ROUND = "Propose every round"  # --one-token-calls: the n-gram service without stretches between its drafts


def start_colocated(args: argparse.Namespace, log_dir: Path, stack: Stack, *extra: str) -> str:
    """A gateway with the target loaded into its own process (`--colocate`) and the n-gram drafter in it too: no gRPC
    at all. Same target flags as the target service, as its TANDEM_TARGET_* settings."""
    flags = ["--no-prefix-cache", *(["--model", args.model] if args.model else []), *shlex.split(args.target_args)]
    target = settings_from_flags(flags)
    print("starting co-located gateway ...", file=sys.stderr, flush=True)
    gateway = start_colocated_gateway(log_dir, target, None, "--n-max", "4", "--local-ngram", *extra)
    stack.processes.append(gateway)
    return gateway.address


def placements(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Where model drafts run: `--draft NAME=FLAGS` (repeatable), else one placement from --draft-args."""
    if not args.draft:
        return [("model", args.draft_args)]
    out = []
    for spec in args.draft:
        name, _, flags = spec.partition("=")
        out.append((f"model@{name}", flags))
    return out


def start_peer(binary: str, extra: list[str], log_dir: Path, stack: Stack, model: str) -> str:
    port = free_port()
    log_path = log_dir / f"llama-server-{port}.log"
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", "1", "--no-webui", *extra]
    peer = _launch_peer(cmd, log_path, f"http://127.0.0.1:{port}")
    stack.peers.append(peer)
    return peer.url


def _launch_peer(cmd: list[str], log_path: Path, url: str) -> Peer:
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    peer = Peer(proc, cmd, log_path, url)
    try:
        wait_http_ok(f"{url}/health", proc, 300)
    except BaseException:
        peer.stop()
        raise
    return peer


# llama-server's n-gram drafters ignore --spec-draft-n-max (that is the draft model's); each has its own lengths.
PEER_NGRAM_DEFAULTS = {
    "ngram-simple": "defaults: 12-gram lookup, 48-token drafts",
    "ngram-mod": "defaults: 24-token match, drafts of 48-64",
}


def peer_ngram_flags(kind: str, k: int) -> list[str]:
    """llama-server flags for its n-gram drafter `kind` drafting at most k tokens."""
    if kind == "ngram-simple":
        return ["--spec-ngram-simple-size-m", str(k)]
    return ["--spec-ngram-mod-n-max", str(k), "--spec-ngram-mod-n-min", "1"]


def lookup_configs(prefix: str, url: str, ngram_ks: list[int], adaptive: bool, long_match: int) -> list[Config]:
    """Target-only, prompt lookup at each k, and (if asked) adaptive, on one gateway; each against its target-only.
    With `long_match`, the same lookup at the longest k drafting only behind matches of that many tokens."""
    base = f"{prefix}target-only"
    top = max(ngram_ks)
    configs = [Config(base, "tandem", url, 0, base)]
    configs += [Config(f"{prefix}ngram k={k}", "tandem", url, k, base, "ngram") for k in ngram_ks]
    if adaptive:
        configs.append(Config(f"{prefix}ngram adaptive<={top}", "tandem", url, top, base, "ngram", True))
    if long_match:
        name = f"{prefix}ngram match>={long_match}"
        configs.append(Config(f"{name} k={top}", "tandem", url, top, base, "ngram", ngram_min=long_match))
        if adaptive:
            configs.append(Config(f"{name} adaptive<={top}", "tandem", url, top, base, "ngram", True, long_match))
    return configs


def one_token_configs(prefix: str, url: str, ngram_ks: list[int], adaptive: bool) -> list[Config]:
    """--one-token-calls on one gateway (`--plain-burst-ms 0`): target-only and (if asked) the adaptive lookup, each
    sending one plain token per Verify call, against the default gateway's same configurations."""
    base = f"{prefix}target-only"
    configs = [Config(prefix + ONE_TOKEN, "tandem", url, 0, base)]
    if adaptive:
        top = max(ngram_ks)
        configs.append(
            Config(f"{prefix}ngram adaptive<={top} {ONE_TOKEN_LOOKUP}", "tandem", url, top, base, "ngram", True)
        )
    return configs


def build_configs(
    args: argparse.Namespace, log_dir: Path, stack: Stack, ks: list[int], ngram_ks: list[int]
) -> list[Config]:
    ngram_url, service_url, model_urls, one_token_url, every_round_url = start_tandem(args, log_dir, stack)
    configs = lookup_configs("", ngram_url, ngram_ks, not args.no_adaptive, args.long_match)
    service_name = f"ngram-service k={max(ks)}"
    configs.append(Config(service_name, "tandem", service_url, max(ks), "target-only", "ngram"))
    if not args.no_adaptive:  # what `make run` serves: the n-gram draft service, adaptive k up to 32
        top = max(ngram_ks)
        configs.append(
            Config(f"ngram-service adaptive<={top}", "tandem", service_url, top, "target-only", "ngram", True)
        )
    if one_token_url:
        configs += one_token_configs("", one_token_url, ngram_ks, not args.no_adaptive)
    if every_round_url:
        configs.append(
            Config(f"{service_name} {EVERY_ROUND}", "tandem", every_round_url, max(ks), "target-only", "ngram")
        )
    if args.colocated:
        colocated = start_colocated(args, log_dir, stack)
        configs += lookup_configs(COLOCATED, colocated, ngram_ks, not args.no_adaptive, args.long_match)
        if args.one_token_calls:
            one = start_colocated(args, log_dir, stack, "--plain-burst-ms", "0")
            configs += one_token_configs(COLOCATED, one, ngram_ks, not args.no_adaptive)
    for name, url in model_urls.items():
        configs += [Config(f"{name} k={k}", "tandem", url, k, "target-only", "model") for k in ks]
        if not args.no_adaptive:
            configs.append(Config(f"{name} adaptive<={max(ks)}", "tandem", url, max(ks), "target-only", "model", True))
    peer = os.environ.get("LLAMA_SERVER")
    if peer:
        from tandem.models import default_model_path

        model = args.model or str(default_model_path())
        extra = shlex.split(args.peer_args)
        print("starting llama-server peers ...", file=sys.stderr, flush=True)
        plain = start_peer(peer, [*extra], log_dir, stack, model)
        configs.append(Config("llama-server", "llama-server", plain, None, "llama-server"))
        for kind, default_label in PEER_NGRAM_DEFAULTS.items():
            for k in [*ngram_ks, None]:
                flags = peer_ngram_flags(kind, k) if k is not None else []
                url = start_peer(peer, [*extra, "--spec-type", kind, *flags], log_dir, stack, model)
                name = f"llama-server {kind} k={k}" if k is not None else f"llama-server {kind} ({default_label})"
                configs.append(Config(name, "llama-server", url, None, "llama-server", "ngram"))
        if not args.no_model_draft:
            draft = args.draft_model or model
            url = start_peer(
                peer,
                [*extra, "-md", draft, "--spec-type", "draft-simple", *shlex.split(args.peer_draft_args)],
                log_dir,
                stack,
                model,
            )
            configs += [Config(f"llama-server -md k={k}", "llama-server", url, k, "llama-server", "model") for k in ks]
    return configs


def machine() -> dict:
    """What the run ran on: a CPU's model and vector extensions change llama.cpp's and numpy's speeds severalfold
    (this project's 2-core machine went from a host with AMX, ~9 ms a target step, to an AVX2-only EPYC, 15-19 ms)."""
    info: dict = {"cpus": os.cpu_count(), "platform": sys.platform}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            info["cpu"] = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            info["simd"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
            break
    return info


def request_body(config: Config, workload: Workload, prompt: str, max_tokens: int, rep: int = 0) -> dict:
    """The chat request of one (configuration, workload prompt, repetition).

    A sampled workload's seed moves on with the repetition (`workload.seed + rep`), the same for every configuration
    in it: a repetition then draws another text instead of the same one again. How much a sampled text repeats
    decides what a lookup can copy, so with one seed the run compared configurations on as many texts as it had
    prompts (full10: the long-match rows drew 49- and 77-token answers on sampled edit, with nothing to copy, in
    both repetitions)."""
    body: dict = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "timings_detail": True,
        "temperature": workload.temperature,
        "cache_prompt": False,  # llama-server: no prompt cache across repetitions (tandem's target runs without)
    }
    body.update(dict(workload.extra))
    if workload.seed is not None:
        body["seed"] = workload.seed + rep
    if workload.temperature > 0:
        # The same distribution on both sides: softmax(logits / T) over the whole vocabulary, tandem's default (top_p
        # 1 and no top-k, as OpenAI's API). Left to its defaults, llama-server would truncate it first (top_k 40,
        # top_p 0.95, min_p 0.05): a different text to draft, and a cheaper draw per token.
        body["top_p"] = 1.0
        body["top_k"] = 0
        if config.family == "llama-server":
            body["min_p"] = 0.0
    if config.n_max is not None:
        body["speculative.n_max"] = config.n_max
        if config.family == "llama-server" and config.n_max:
            body["speculative.n_min"] = 0
        if config.family == "tandem":
            body["speculative.adaptive"] = config.adaptive
        if config.ngram_min is not None:
            body["speculative.ngram_min"] = config.ngram_min
    return body


def request(
    client: httpx.Client, config: Config, workload: Workload, prompt: str, max_tokens: int, rep: int = 0
) -> Record:
    body = request_body(config, workload, prompt, max_tokens, rep)
    t0 = time.perf_counter()
    response = client.post(f"{config.url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    data = response.json()
    return Record(config.name, workload.name, 0, 0, data["choices"][0]["message"]["content"], data.get("timings", {}),
                  time.perf_counter() - t0)  # fmt: skip


def run(
    configs: list[Config],
    loads: list[Workload],
    reps: int,
    max_tokens: int,
    records: list[Record] | None = None,
    before_rep: Callable[[int], None] | None = None,
) -> list[Record]:
    """Every configuration on every prompt, `reps` times; appends to `records` as it goes (an interrupted run keeps
    what it measured). `before_rep(rep)` runs before each repetition after the first (e.g. fresh peers)."""
    from tqdm import tqdm

    total = reps * sum(len(w.prompts) for w in loads) * len(configs)
    records = [] if records is None else records
    with httpx.Client() as client, tqdm(total=total, desc="bench", unit="req", file=sys.stderr) as bar:
        # Warm-up: one short request per configuration (first-touch allocations, page cache).
        for config in configs:
            request(client, config, loads[0], "Hello", 8)
        for rep in range(reps):
            if rep and before_rep is not None:
                before_rep(rep)
                for config in configs:  # restarted servers start cold again
                    request(client, config, loads[0], "Hello", 8)
            for workload in loads:
                for i, prompt in enumerate(workload.prompts):
                    shift = (rep + i) % len(configs)
                    for config in configs[shift:] + configs[:shift]:  # rotate the order: noise hits all alike
                        if not workload.peer and config.family == "llama-server":
                            bar.update()
                            continue
                        bar.set_postfix_str(f"{workload.name} | {config.name}")
                        record = request(client, config, workload, prompt, max_tokens, rep)
                        record.prompt, record.rep = i, rep
                        records.append(record)
                        bar.update()
    return records


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _per_prompt(recs: list[Record]) -> dict[int, float]:
    """Each prompt's median decode tok/s over the repetitions."""
    by_prompt: dict[int, list[float]] = defaultdict(list)
    for r in recs:
        if r.timings.get("predicted_per_second"):
            by_prompt[r.prompt].append(r.timings["predicted_per_second"])
    return {p: statistics.median(v) for p, v in by_prompt.items()}


def _geomean(values: list[float]) -> float | None:
    return statistics.geometric_mean(values) if values else None


def summarise(configs: list[Config], loads: list[Workload], records: list[Record]) -> list[dict]:
    by = defaultdict(list)
    for r in records:
        by[(r.config, r.workload)].append(r)
    rows = []
    for workload in loads:
        for config in configs:
            recs = by[(config.name, workload.name)]
            base = {(r.prompt, r.rep): r for r in by[(config.baseline, workload.name)]}
            rates, base_rates = _per_prompt(recs), _per_prompt(list(base.values()))
            tok_s = _geomean(list(rates.values()))
            ratios = [rates[p] / base_rates[p] for p in rates if p in base_rates]
            drafted = sum(r.timings.get("draft_n", 0) or 0 for r in recs)
            accepted = sum(r.timings.get("draft_n_accepted", 0) or 0 for r in recs)
            rounds = sum(r.timings.get("rounds", 0) or 0 for r in recs)
            predicted_ms = sum(r.timings.get("predicted_ms", 0) or 0 for r in recs)
            predicted_n = sum(r.timings.get("predicted_n", 0) or 0 for r in recs)
            draft_ms = sum(r.timings.get("draft_compute_ms", 0) or 0 for r in recs)
            verify_ms = sum(r.timings.get("verify_compute_ms", 0) or 0 for r in recs)
            mask_ms = sum(r.timings.get("verify_mask_ms", 0) or 0 for r in recs)
            # Target steps (a target-only call can run several), or calls where a reply predates the field.
            verify_steps = sum(r.timings.get("verify_steps", r.timings.get("verify_calls", 0)) or 0 for r in recs)
            pos_acc: list[int] = []
            pos_n: list[int] = []
            for r in recs:
                for i, (a, n) in enumerate(
                    zip(
                        r.timings.get("accepted_per_position", []),
                        r.timings.get("drafts_per_position", []),
                        strict=False,
                    )
                ):
                    if i >= len(pos_acc):
                        pos_acc.append(0)
                        pos_n.append(0)
                    pos_acc[i] += a
                    pos_n[i] += n
            tandem = config.family == "tandem"
            compute_ms = draft_ms + verify_ms + mask_ms
            same = None
            if workload.temperature == 0 and config.baseline != config.name:
                pairs = [(r, base.get((r.prompt, r.rep))) for r in recs]
                same = sum(1 for r, b in pairs if b is not None and r.text == b.text) / max(len(pairs), 1)
            rows.append(
                {
                    "config": config.name,
                    "family": config.family,
                    "drafter": config.drafter,
                    "workload": workload.name,
                    "n": len(recs),
                    "tok_s": tok_s,
                    "ttft_ms": _median([r.timings.get("prompt_ms") for r in recs]),
                    "acceptance": accepted / drafted if drafted else None,
                    "mean_accepted_length": (accepted + rounds) / rounds if rounds else None,
                    "speedup": _geomean(ratios),
                    "same_text": same,
                    "draft_pct": 100 * draft_ms / predicted_ms if tandem and predicted_ms else None,
                    "verify_pct": 100 * verify_ms / predicted_ms if tandem and predicted_ms else None,
                    "mask_pct": 100 * mask_ms / predicted_ms if tandem and predicted_ms else None,
                    "mask_us_per_step": 1000 * mask_ms / verify_steps if tandem and verify_steps and mask_ms else None,
                    "overhead_pct": 100 * (predicted_ms - compute_ms) / predicted_ms
                    if tandem and predicted_ms
                    else None,
                    "ideal_tok_s": 1000 * predicted_n / compute_ms if tandem and compute_ms else None,
                    "efficiency": compute_ms / predicted_ms if tandem and predicted_ms else None,
                    "draft_ms_per_token": draft_ms / drafted if tandem and drafted and draft_ms else None,
                    "verify_ms_per_step": verify_ms / verify_steps if tandem and verify_steps else None,
                    "acceptance_by_position": [a / n if n else None for a, n in zip(pos_acc, pos_n, strict=True)],
                }
            )
    return rows


def select_configs(configs: list[Config], pattern: str) -> list[Config]:
    """The configurations whose name matches `pattern` (a regular expression), with the baselines they are compared
    with, in their original order."""
    import re

    wanted = {c.name for c in configs if re.search(pattern, c.name)}
    wanted |= {c.baseline for c in configs if c.name in wanted}
    chosen = [c for c in configs if c.name in wanted]
    if not chosen:
        raise SystemExit(f"--only {pattern!r} matches no configuration: {', '.join(c.name for c in configs)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one prompt per workload, one repetition, k=4 only")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default: 1 quick, 3 full)")
    parser.add_argument("--ks", default=None, help="draft lengths, comma-separated (default: 4 quick, 2,4,8 full)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--workloads", default=None, help="comma-separated subset of workload names")
    parser.add_argument("--model", default=None, help="target GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--draft-model", default=None, help="draft GGUF for the model drafter (default: --model)")
    parser.add_argument("--target-args", default="", help="extra flags for the target service, e.g. GPU layers")
    parser.add_argument("--draft-args", default="", help="extra flags for the model draft service")
    parser.add_argument(
        "--draft",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="a model-draft placement, repeatable, e.g. 'cpu=--device cpu --n-threads 8' 'gpu=--n-gpu-layers -1'; its"
        " flags may name the drafter: 'chained=--drafter ngram,model'",
    )
    parser.add_argument(
        "--peer-args",
        default="-c 4096 --no-repack -fa off",
        help="flags for every llama-server (e.g. -ngl 99); --no-repack matches tandem's engine, whose AMX repack path"
        " crashes on this CPU",
    )
    parser.add_argument(
        "--peer-draft-args", default="", help="extra flags for llama-server's -md draft (e.g. -ngld 99)"
    )
    parser.add_argument(
        "--ngram-ks",
        default=None,
        help="extra draft lengths for the n-gram drafters only (tandem's and llama-server's), e.g. 16,32: a drafter"
        " that costs nothing per token can draft long copies in one round",
    )
    parser.add_argument("--no-model-draft", action="store_true", help="skip the model drafter configurations")
    parser.add_argument(
        "--colocated",
        action="store_true",
        help="add the target-only and n-gram configurations of a co-located gateway (the target in the gateway's"
        " process, `--colocate`), each compared with its own target-only mode",
    )
    parser.add_argument("--no-adaptive", action="store_true", help="skip the adaptive draft length configurations")
    parser.add_argument(
        "--one-token-calls",
        action="store_true",
        help="add target-only and the adaptive lookup through a gateway that asks the target for one plain token per"
        " call (`--plain-burst-ms 0`), against the default (several tokens a call where steps are short); co-located"
        " too with --colocated; and the n-gram draft service with a Propose every round (`--plain-pipeline 1`: no"
        " target-only stretches between its drafts)",
    )
    parser.add_argument(
        "--long-match",
        type=int,
        default=12,
        metavar="N",
        help="add n-gram configurations that draft only behind a suffix match of at least N tokens (per request,"
        " `speculative.ngram_min`; llama-server's ngram-simple waits for 12); 0 = none",
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="REGEX",
        help="run only the configurations whose name matches (and their baselines), e.g. 'target-only|^llama-server$'",
    )
    parser.add_argument(
        "--fresh-peers",
        action="store_true",
        help="restart the llama-servers before each repetition: a repetition then meets no state an earlier one left"
        " (ngram-mod's n-gram pool drafts a repeated prompt's earlier answer, which tandem keeps no memory of)",
    )
    parser.add_argument("--out", type=Path, default=None, help="results folder (default bench/results/<time>)")
    parser.add_argument("--label", default="", help="a note stored with the results (machine, date, ...)")
    parser.add_argument(
        "--resummarise", type=Path, default=None, metavar="RESULTS_JSON",
        help="recompute the tables and plots of an earlier run from its records (written beside it), run nothing",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency",
        default=None,
        help="e.g. 1,2,4,8,16: aggregate tok/s with speculation on and off by concurrent streams instead (the make run"
        " stack; --workloads, --reps, --max-tokens, --model, --target-args apply; see bench/concurrency.py)",
    )
    parser.add_argument("--per-stream", type=int, default=2, help="--concurrency: requests each stream makes in turn")
    parser.add_argument(
        "--window-s",
        type=float,
        default=0.0,
        help="--concurrency: measure each sample over a window of this many seconds, every stream busy throughout"
        " (0: each stream's --per-stream requests, start to finish)",
    )
    parser.add_argument("--gateway-args", default="", help="--concurrency: extra gateway flags")
    args = parser.parse_args(argv)
    if args.concurrency:
        from bench import concurrency

        args.reps = args.reps or 2
        return concurrency.main(args)
    if args.resummarise:
        return resummarise(args.resummarise)

    ks = [int(k) for k in (args.ks or ("4" if args.quick else "2,4,8")).split(",")]
    ngram_ks = sorted({*ks, *(int(k) for k in args.ngram_ks.split(",") if k)}) if args.ngram_ks else ks
    reps = args.reps or (1 if args.quick else 3)
    loads = workloads(args.quick)
    if args.workloads:
        wanted = set(args.workloads.split(","))
        loads = [w for w in loads if w.name in wanted]
    out = args.out or Path("bench/results") / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    log_dir = out / "logs"
    log_dir.mkdir(exist_ok=True)

    from bench.report import write_report

    stack = Stack()
    try:
        configs = build_configs(args, log_dir, stack, ks, ngram_ks)
        if args.only:
            configs = select_configs(configs, args.only)
        started = time.time()
        records: list[Record] = []
        interrupted = False
        # SIGTERM (a timeout, a killed job) ends the run like Ctrl-C: the report covers the requests done so far.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            peer_urls = {c.url for c in configs if c.family == "llama-server"}
            fresh = functools.partial(_fresh_peers, stack, peer_urls) if args.fresh_peers and peer_urls else None
            run(configs, loads, reps, args.max_tokens, records, fresh)
        except KeyboardInterrupt:
            if not records:
                raise
            interrupted = True
            print(f"\ninterrupted: writing the report of the {len(records)} requests done", file=sys.stderr)
        rows = summarise(configs, loads, records)
        meta = {
            "command": " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "label": args.label,
            "reps": reps,
            "ks": ks,
            "max_tokens": args.max_tokens,
            "fresh_peers": bool(args.fresh_peers),
            "seconds": round(time.time() - started, 1),
            "machine": machine(),
            **({"interrupted_after_requests": len(records)} if interrupted else {}),
        }
        write_report(out, meta, rows, records, *_versus(configs, records))
    finally:
        stack.stop()
    return 0


def resummarise(path: Path) -> int:
    """Tables, JSON and plots of an earlier run, recomputed from its records with today's statistics."""
    import json

    from bench.report import write_report

    data = json.loads(path.read_text())
    records = [Record(**r) for r in data["records"]]
    configs, seen = [], set()
    for row in data["rows"]:
        if row["config"] not in seen:
            seen.add(row["config"])
            baseline = "target-only" if row["family"] == "tandem" else "llama-server"
            if row["config"].startswith(COLOCATED):
                baseline = f"{COLOCATED}target-only"
            configs.append(Config(row["config"], row["family"], "", None, baseline, row.get("drafter", "none")))
    by_name = {w.name: w for w in workloads(False)}
    loads = [by_name[name] for name in dict.fromkeys(r.workload for r in records)]
    meta = {**data["meta"], "resummarised": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    write_report(path.parent, meta, summarise(configs, loads, records), records, *_versus(configs, records))
    return 0


def _fresh_peers(stack: Stack, urls: set[str], rep: int) -> None:
    print(f"\nrepetition {rep + 1}: restarting {len(urls)} llama-server(s)", file=sys.stderr, flush=True)
    stack.restart_peers(urls)


def _versus(configs: list[Config], records: list[Record]) -> tuple[list[dict], dict[str, float], list[dict]]:
    """The best-against-best comparison, the baselines' spread between repetitions, and target-only against
    llama-server's plain decoding (bench.versus)."""
    from bench.versus import baseline_spread, plain_versus, versus

    baselines = list(dict.fromkeys(c.baseline for c in configs))
    ours = [b for b in baselines if any(c.name == b and c.family == "tandem" for c in configs)]
    return versus(configs, records), baseline_spread(records, baselines), plain_versus(records, ours)


if __name__ == "__main__":
    sys.exit(main())
