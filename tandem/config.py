"""Settings for the three services: pydantic-settings classes whose fields carry bounds and help.

Each setting can come from a CLI flag (`--n-gpu-layers 99`), an environment variable with the service's prefix
(`TANDEM_TARGET_N_GPU_LAYERS=99`), or its default. The defaults run the whole stack on this CPU on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The n-gram lookup's defaults (tandem.ngram) live here, not there: this module is imported before llama_cpp
# (`prepare_process`), and tandem.ngram imports numpy, which must come after it.
NGRAM_MIN = 2  # shortest suffix matched by default: a one-token match drafts noise
NGRAM_MAX = 32
"""Longest suffix looked up by default. The latest occurrence of the longest suffix decides the draft, so a longer
one tells apart repeats that share their last 16 tokens but not what follows them (a looping answer's sentence that
ends a paragraph in one place and not in another). Replayed on full8's recorded texts (`python -m bench.replay_ngram
--ngram-min 12 --ngram-max 16|32`), the chat answer that loops went from 141 of 154 drafted tokens accepted in 8
rounds to 142 of 143 in 7; the other workloads' drafts did not change."""

KvCacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]


MAX_DEFAULT_SESSIONS = 16


def session_layout(n_ctx: int, max_sessions: int | None, n_ctx_train: int) -> tuple[int, int]:
    """(session slots, KV cells) for `n_ctx` cells: unless the slots are given, as many as hold the model's training
    context each (at least 1, at most 16); and never more cells a slot than that context."""
    train = n_ctx_train if n_ctx_train > 0 else n_ctx
    slots = max_sessions or max(1, min(MAX_DEFAULT_SESSIONS, n_ctx // train))
    return slots, min(n_ctx, train * slots)


class EngineSettings(BaseSettings):
    """How one model is loaded and pinned: one backend, one device, a bounded number of sessions."""

    model: str | Path | None = Field(
        None, description="GGUF path, or smollm2-135m (the default) or gemma3-270m (from PyPI)"
    )
    device: str | None = Field(
        None,
        pattern=r"^(cpu|(gpu|cuda|rocm|hip|vulkan):\d+)$",
        description="pin the process to one device ('cpu' hides every GPU; 'cuda:1' / 'vulkan:0' shows only that one)",
    )
    n_gpu_layers: int = Field(0, ge=-1, description="layers to offload to the GPU (-1 = all, 0 = CPU only)")
    main_gpu: int = Field(0, ge=0, description="GPU index the model is pinned to (with split_mode none)")
    split_mode: Literal["none", "layer", "row"] = Field(
        "none", description="none pins the model to main_gpu; layer/row spread it over all visible GPUs"
    )
    n_threads: int = Field(0, ge=0, description="CPU threads for decoding (0 = all cores)")
    n_threads_batch: int = Field(0, ge=0, description="CPU threads for prefill/verify batches (0 = n_threads)")
    n_ctx: int = Field(
        32768, ge=64, description="KV cells of the whole context, split evenly between the session slots"
    )
    n_batch: int = Field(512, ge=16, description="largest batch given to one llama_decode call")
    # A prompt is prefilled in chunks of n_batch tokens, and other sessions' steps run between chunks. Where a chunk
    # takes seconds (a CPU draft: ~1.5 s for 512 tokens of SmolLM2 on the 2-core CPU) every running stream waits that
    # long for each; with this budget, while other sessions step, chunks are cut to what the measured prefill speed
    # does in it. Off (0) on the target, whose prefill chunking then never depends on load: a chunk's size moves
    # logits by an ulp, and the target's text must not depend on what else runs. The draft's default is in
    # DraftSettings.
    prefill_chunk_ms: float = Field(
        0.0, ge=0, description="while other sessions step, prefill chunks of about this long (0 = n_batch tokens)"
    )
    # Unset: a session may use the model's whole training context (as llama-server serves it), so the slots are as
    # many as --n-ctx holds at that size (SmolLM2's 8k: 4 in 32k cells; Gemma 3's 32k: 1). Set it for more, shorter
    # slots; a slot never gets more than the training context.
    max_sessions: int | None = Field(
        None,
        ge=1,
        le=256,
        description="session slots live at once (unset: as many as --n-ctx holds at the model's training context)",
    )
    prefix_cache: bool = Field(
        True,
        description="keep a finished session's KV cells to reuse the longest prefix a later prompt shares with them",
    )
    cache_type_k: KvCacheType = Field("f16", description="KV cache type for keys (q8_0 halves the memory)")
    cache_type_v: KvCacheType = Field("f16", description="KV cache type for values (quantised V needs flash attention)")
    # auto: faster on a GPU, slower on the CPU. On the CPU, 'on' makes batched verification bit-identical to one-token
    # decoding (greedy speculative text then equals target-only text), at the cost of slower one-token steps.
    flash_attn: Literal["auto", "on", "off"] = Field(
        "auto", description="flash attention; auto: on when layers run on a GPU or the V cache is quantised, else off"
    )
    # off keeps a session's numerics independent of the others' (temperature-0 text under load equals the same request
    # alone, on the CPU); on a GPU, batched steps over per-session slices are slower and kernels vary by batch anyway.
    kv_unified: Literal["auto", "on", "off"] = Field(
        "auto",
        description="on: one KV buffer for all sessions; off: one slice per session; auto: on when offloaded to a GPU",
    )

    # A greedy session's tokens are the argmax of its logits rows; on a GPU, copying every row out (a vocabulary of
    # floats each) and taking the argmax in numpy is a large part of a verify step's own time under load.
    device_argmax: Literal["auto", "on", "off"] = Field(
        "auto",
        description="greedy sessions' argmax by llama.cpp's backend sampler, no logits copied; auto: on a GPU",
    )

    # One llama_decode call a step however many draft lengths it holds (one KV buffer only). auto: on a GPU, where a
    # call whose layout changed from the one before costs a CUDA graph capture, and packing led one call per length in
    # every cell of every lease under load (docs/decisions/0022). It runs there with llama.cpp's graph reuse off
    # (`graph_reuse`): with reuse on it crashed CUDA in 2 of 8 runs, without it in none of 9. Off on the CPU, where
    # one call per length costs nothing more and each length keeps its own numerics.
    pack_steps: Literal["auto", "on", "off"] = Field(
        "auto",
        description="with one KV buffer, decode a step's sequences of unequal lengths in one call; auto: on a GPU",
    )

    def resolved_pack_steps(self, on_gpu: bool) -> bool:
        return self.pack_steps == "on" or (self.pack_steps == "auto" and on_gpu)

    def resolved_device_argmax(self, on_gpu: bool) -> bool:
        return self.device_argmax == "on" or (self.device_argmax == "auto" and on_gpu)

    def resolved_flash_attn(self, on_gpu: bool) -> bool:
        if self.flash_attn != "auto":
            return self.flash_attn == "on"
        return on_gpu or self.cache_type_v not in ("f32", "f16", "bf16")

    def resolved_kv_unified(self, on_gpu: bool) -> bool:
        return self.kv_unified == "on" or (self.kv_unified == "auto" and on_gpu)

    # Off by default: the AMX path of llama-cpp-python 0.3.36 segfaults on Sapphire Rapids CPUs.
    extra_buffers: bool = Field(False, description="let llama.cpp repack CPU weights into extra buffer types (AMX...)")
    session_idle_timeout_s: float = Field(300.0, gt=0, description="close sessions idle for longer than this")
    # see docs/decisions/0002-openmp-spin-wait.md
    omp_spin_count: int = Field(
        10000,
        ge=-1,
        description="how long llama.cpp's OpenMP workers spin before sleeping (GOMP_SPINCOUNT; -1 = libgomp's default)",
    )

    def pin_device(self) -> None:
        """Make only the chosen device visible to this process. Must run before llama_cpp is imported."""
        if self.device is None:
            return
        hide_all = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "ROCR_VISIBLE_DEVICES": "",
                    "GGML_VK_VISIBLE_DEVICES": ""}  # fmt: skip
        if self.device == "cpu":
            os.environ.update(hide_all)
            self.n_gpu_layers = 0
            return
        var, index = self.device_variable()
        os.environ[var] = index
        self.main_gpu = 0  # the one visible device

    def device_variable(self) -> tuple[str, str]:
        """(the environment variable that selects GPUs for this device's backend, the device's index)."""
        assert self.device is not None and self.device != "cpu"
        kind, index = self.device.split(":")
        return DEVICE_VARIABLES[kind], index

    def resolved_threads(self) -> tuple[int, int]:
        n = self.n_threads or os.cpu_count() or 1
        return n, self.n_threads_batch or n


DEVICE_VARIABLES = {"gpu": "CUDA_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES",
                    "hip": "HIP_VISIBLE_DEVICES", "vulkan": "GGML_VK_VISIBLE_DEVICES"}  # fmt: skip


def limit_omp_spin(*models: EngineSettings) -> None:
    """Set GOMP_SPINCOUNT for this process from the models' `omp_spin_count` (the lowest asked for). Must run before
    llama_cpp is imported: libgomp reads it once, when it is loaded. A GOMP_SPINCOUNT or OMP_WAIT_POLICY already in
    the environment is the operator's choice and is left alone."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return
    counts = [m.omp_spin_count for m in models if m.omp_spin_count >= 0]
    if counts:
        os.environ["GOMP_SPINCOUNT"] = str(min(counts))


def prepare_process(*models: EngineSettings, colocated: bool = False) -> None:
    """Ready this process for llama.cpp, in the one order that works, for both entry points (the services'
    tandem.cli.service_main and the co-located gateway): pin the models to their devices, set libgomp's spin count,
    then import llama_cpp. The first two must happen before llama_cpp loads (the device runtimes and libgomp read
    the environment once); llama_cpp must come before grpc and numpy (on the CUDA image, grpc first makes model
    loading segfault; numpy first crashes the tokenizer), so callers import neither before this."""
    if colocated:
        pin_colocated(*models)
    else:
        for model in models:
            model.pin_device()
    limit_omp_spin(*models)
    import tandem.engine  # noqa: F401


def pin_colocated(*models: EngineSettings) -> None:
    """Pin models that share one process (the co-located gateway) to their devices before llama_cpp is imported.

    A process sees one set of devices, so each model cannot hide the others': the GPUs named are made visible
    together, each model is pinned to its own by main_gpu (split_mode none), and a 'cpu' model simply offloads no
    layers. One process runs one llama.cpp build, so the GPUs must share a backend; models on a CUDA and a ROCm
    card run as separate services instead.
    """
    gpus: dict[str, list[str]] = {}
    for model in models:
        if model.device not in (None, "cpu"):
            var, index = model.device_variable()
            gpus.setdefault(var, [])
            if index not in gpus[var]:
                gpus[var].append(index)
    if len(gpus) > 1:
        raise ValueError(
            f"co-located models need one GPU backend, got {sorted(gpus)}: run them as separate services instead"
        )
    for var, indices in gpus.items():
        os.environ[var] = ",".join(indices)
    for model in models:
        if model.device == "cpu":
            model.n_gpu_layers = 0
        elif model.device is not None:
            var, index = model.device_variable()
            model.main_gpu = gpus[var].index(index)
            model.split_mode = "none"
        model.device = None  # pinned here: Engine must not pin again


class ServiceSettings(EngineSettings):
    host: str = Field("127.0.0.1", description="address to listen on; anything but loopback is an explicit choice")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 = pick a free one and print it)")
    frame_port: int = Field(
        0,
        ge=-1,
        le=65535,
        description="port of the frame transport for Verify/Propose, told to callers in Info (0 = pick a free one, "
        "-1 = off: callers use gRPC streams); same TLS and token as gRPC",
    )
    tls_cert: Path | None = Field(None, description="PEM certificate: serve gRPC over TLS (with --tls-key)")
    tls_key: Path | None = Field(None, description="PEM private key of --tls-cert")
    tls_client_ca: Path | None = Field(
        None, description="PEM CA: require client certificates signed by it (mutual TLS)"
    )
    auth_token: str | None = Field(
        None, description="shared token: every call but health checks must send 'authorization: Bearer <token>'"
    )
    max_batch: int = Field(
        64, ge=1, le=1024, description="calls merged into one engine step (continuous batching; 1 = one at a time)"
    )
    batch_wait_ms: float = Field(
        20.0,
        ge=0,
        le=1000,
        description="how long a step waits for the last step's callers to return, to batch them (0 = no wait)",
    )
    # auto is off for a CPU model: llama.cpp's OpenMP keeps a worker pool per calling thread, and a second pool in the
    # process slows every CPU forward pass. Other calls wait at most one step. See
    # docs/decisions/0011-retired-experiments.md
    single_stream_inline: Literal["auto", "on", "off"] = Field(
        "auto",
        description="with one active session, run its steps on the serving thread"
        " (auto: on for a GPU model or the n-gram drafter)",
    )

    def inline_steps(self, backend: str | None) -> bool:
        """Whether single-stream steps run inline, for an engine on `backend` (None: no engine)."""
        if self.single_stream_inline != "auto":
            return self.single_stream_inline == "on"
        return backend != "CPU"

    log_level: Literal["debug", "info", "warning", "error"] = "info"


class TargetSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TANDEM_TARGET_",
        env_ignore_empty=True,  # TANDEM_..._MODEL= (empty, as compose files leave it) means the default
        cli_parse_args=False,
        cli_kebab_case=True,
        cli_implicit_flags=True,
    )

    verify_mode: Literal["batched", "sequential"] = Field(
        "batched",
        description="batched: verify all draft tokens in one forward pass"
        "; sequential: one pass a token (bit-identical to target-only)",
    )


class DraftSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TANDEM_DRAFT_",
        env_ignore_empty=True,  # TANDEM_..._MODEL= (empty, as compose files leave it) means the default
        cli_parse_args=False,
        cli_kebab_case=True,
        cli_implicit_flags=True,
    )

    port: int = Field(50052, ge=0, le=65535, description="gRPC port (0 = pick a free one and print it)")
    drafter: Literal["ngram", "model", "ngram,model"] = Field(
        "ngram",
        description="model: a small GGUF; ngram: prompt lookup; ngram,model: lookup first, the model where it finds"
        " nothing",
    )
    ngram_max: int = Field(NGRAM_MAX, ge=1, le=32, description="n-gram drafter: longest suffix to look up")
    ngram_min: int = Field(
        NGRAM_MIN, ge=1, le=32, description="n-gram drafter: shortest suffix to match (shorter matches draft noise)"
    )
    draft_support: int = Field(
        256, ge=1, le=4096, description="model drafter, sampling: tokens kept in the draft distribution it sends"
    )
    # A draft's numerics decide only what it proposes, never the text: its prefill may follow the load.
    prefill_chunk_ms: float = Field(
        50.0, ge=0, description="while other sessions step, prefill chunks of about this long (0 = n_batch tokens)"
    )


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="TANDEM_GATEWAY_", cli_parse_args=False, cli_kebab_case=True, cli_implicit_flags=True
    )

    host: str = Field("127.0.0.1", description="HTTP address; anything but loopback is an explicit choice")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port of the OpenAI-compatible API")
    target: str = Field("127.0.0.1:50051", description="target service address")
    draft: str | None = Field("127.0.0.1:50052", description="draft service address (empty = target only)")
    local_ngram: bool = Field(
        False,
        description="draft by prompt lookup inside the gateway instead of calling a draft service (--draft unused)",
    )
    # Longer minimums draft less often, but only inside text that really repeats (fewer near-ties flipped in prose).
    local_ngram_min: int = Field(NGRAM_MIN, ge=1, le=32, description="--local-ngram: shortest suffix match that drafts")
    local_ngram_max: int = Field(NGRAM_MAX, ge=1, le=32, description="--local-ngram: longest suffix to look up")
    # see docs/decisions/0010-target-side-lookup.md
    target_lookup: bool = Field(
        True,
        description="--local-ngram: the target drafts by the gateway's lookup rule in target-only calls, if supported",
    )
    # see docs/decisions/0009-lookup-stretches-follow-ups-continued-rounds.md
    continue_rounds: bool = Field(
        True,
        description="n-gram draft service: a round likely to fail asks the target to keep decoding in the same call",
    )
    # For models on one host and one llama.cpp build; see docs/decisions/0006-colocation.md
    colocate: bool = Field(
        False,
        description="run the target and draft in the gateway's process, without gRPC"
        " (settings: TANDEM_TARGET_*/TANDEM_DRAFT_*)",
    )
    colocate_target: bool = Field(
        False,
        description="run the target in the gateway's process and keep the draft a gRPC service at --draft"
        " (the mixed-vendor layout; target settings: TANDEM_TARGET_*)",
    )
    model_name: str | None = Field(None, description="model id served on /v1/models (default: the target's name)")
    # see docs/decisions/0001-default-draft-lengths.md
    n_max: int | None = Field(
        None,
        ge=0,
        le=64,
        description="default draft tokens per round (0 = no speculation; unset: 8 for a model drafter, 32 for n-gram)",
    )
    n_min: int = Field(0, ge=0, le=64, description="drafts shorter than this are not verified")
    # Off by default: on a shared device the draft and the target compete and it loses (the compose file and the chart
    # turn it on, with the draft on another device). See docs/decisions/0011-retired-experiments.md
    overlap_draft: bool = Field(
        False,
        description="model drafters: draft the next round while the target verifies this one (draft on another device)",
    )
    # see docs/decisions/0015-cross-vocabulary-drafting.md
    cross_vocab: Literal["auto", "string", "intersection"] = Field(
        "auto",
        description="a draft model of another vocabulary: string (its text, tokenized by the target and verified as"
        " fixed drafts), intersection (sampled from the tokens both vocabularies share, verified with its q) or auto"
        " (string for greedy requests, intersection for sampled ones: what measured best)",
    )
    # Choices follow measured timings, so temperature-0 text can differ at a near-tie between runs; seeded sampled
    # requests keep a fixed k unless they ask for adaptive k. See docs/decisions/0001-default-draft-lengths.md
    adaptive_k: bool = Field(
        True, description="choose each round's draft length in n_min..n_max from verification cost and acceptance"
    )
    # Above 1, prompt lookup also sends the rounds between its drafts this way, as calls the target ends at the next
    # repeat. See docs/decisions/0008-target-only-pipelining-and-plain-burst.md
    plain_pipeline: int = Field(
        2, ge=1, le=4, description="target-only decoding: Verify calls kept in flight per request (1 = one at a time)"
    )
    # see docs/decisions/0008-target-only-pipelining-and-plain-burst.md
    plain_burst_ms: float = Field(
        100.0,
        ge=0,
        le=1000,
        description="target-only decoding: each Verify call asks for the tokens the target computes in this long"
        " (at most 16; 0 = one)",
    )
    max_tokens_default: int = Field(512, ge=1, description="max_tokens when the request gives none")
    rpc_timeout_s: float = Field(30.0, gt=0, description="deadline of each gRPC call but the prefill")
    # An agent's 8k-token prompt takes ~40 s to prefill on a 2-core CPU.
    open_timeout_s: float = Field(600.0, gt=0, description="deadline of the prefill (Open) of a request's prompt")
    startup_timeout_s: float = Field(600.0, gt=0, description="how long to wait for the services at start")
    upstream_tls_ca: Path | None = Field(None, description="PEM CA: talk TLS to the services, verifying them")
    upstream_tls_cert: Path | None = Field(None, description="PEM client certificate for mutual TLS")
    upstream_tls_key: Path | None = Field(None, description="PEM private key of --upstream-tls-cert")
    upstream_token: str | None = Field(None, description="shared token sent to the services (their --auth-token)")
    upstream_frames: bool = Field(
        True,
        description="Verify and Propose over the services' frame ports where they offer one (cheaper a call than "
        "gRPC streams, same TLS and token); off: gRPC streams only",
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description='accepted Bearer keys (TANDEM_GATEWAY_API_KEYS=\'["k1","k2"]\'); empty = no authentication',
    )
    max_concurrent: int = Field(8, ge=1, description="requests generating at once (more wait in the queue)")
    draft_max_running: int = Field(
        0,
        ge=0,
        description="a request that starts while more than this many generations run (itself included) decodes"
        " target-only: speculation sheds load on a busy server (0: no limit)",
    )
    max_queue: int = Field(64, ge=0, description="requests waiting for a slot; beyond this: 429 with Retry-After")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="largest request body accepted (413 above)")
    max_tokens_limit: int = Field(8192, ge=1, description="most tokens one answer may have (larger max_tokens: capped)")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _lookup_lengths_ordered(self) -> GatewaySettings:
        if self.local_ngram_min > self.local_ngram_max:
            raise ValueError(
                f"local_ngram_min ({self.local_ngram_min}) must not exceed local_ngram_max ({self.local_ngram_max})"
            )
        return self


@contextlib.contextmanager
def graph_reuse(allowed: bool) -> Iterator[None]:
    """Around the creation of a llama.cpp context: its graph reuse off where not `allowed` (llama.cpp reads
    LLAMA_GRAPH_REUSE_DISABLE when it creates a context, so the process's other contexts keep theirs).

    Packed steps on a GPU go without it: a reused graph skips the CUDA backend's check of what changed and replays the
    recorded one, the suspect of the CUDA crash that keeps packing opt-in (decision 0022); on the CPU reuse is exact
    for such steps (tests/test_engine.py)."""
    if allowed:
        yield
        return
    before = os.environ.get("LLAMA_GRAPH_REUSE_DISABLE")
    os.environ["LLAMA_GRAPH_REUSE_DISABLE"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["LLAMA_GRAPH_REUSE_DISABLE"]
        else:
            os.environ["LLAMA_GRAPH_REUSE_DISABLE"] = before
