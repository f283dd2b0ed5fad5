"""Settings for the three services: pydantic-settings classes whose fields carry bounds and help.

Each setting can come from a CLI flag (`--n-gpu-layers 99`), an environment variable with the service's prefix
(`TANDEM_TARGET_N_GPU_LAYERS=99`), or its default. The defaults run the whole stack on this CPU on 127.0.0.1.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tandem.ngram import NGRAM_MAX, NGRAM_MIN

KvCacheType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]


class EngineSettings(BaseSettings):
    """How one model is loaded and pinned: one backend, one device, a bounded number of sessions."""

    model: Path | None = Field(None, description="GGUF file; default: the embedded SmolLM2-135M-Instruct")
    device: str | None = Field(
        None,
        pattern=r"^(cpu|(gpu|cuda|rocm|hip|vulkan):\d+)$",
        description="pin the process to one device before llama.cpp starts: 'cpu' hides every GPU (no GPU memory"
        " at all), 'cuda:1' / 'rocm:0' / 'vulkan:0' shows only that one (it becomes device 0 inside the process)",
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
    max_sessions: int = Field(
        16,
        ge=1,
        le=256,
        description="session slots (KV sequences): live sessions at once; free slots keep finished sessions' KV"
        " for prefix reuse",
    )
    prefix_cache: bool = Field(
        True,
        description="keep a finished session's KV cells in its slot and reuse the longest shared prefix of a later"
        " prompt (multi-turn chat, agents re-sending a system prompt); least recently used slots are reused first",
    )
    cache_type_k: KvCacheType = Field("f16", description="KV cache type for keys (q8_0 halves the memory)")
    cache_type_v: KvCacheType = Field("f16", description="KV cache type for values (quantised V needs flash attention)")
    flash_attn: Literal["auto", "on", "off"] = Field(
        "auto",
        description="flash attention; auto: on when layers run on a GPU (70B target-only on an H200: 55.2 against"
        " 48.9 tok/s) or the V cache is quantised (which needs it), off on the CPU (a 1,000-token context decoded ~25%"
        " slower with it on a 2-core CPU). On the CPU, 'on' makes batched verification bit-identical to one-token"
        " decoding, so greedy speculative text equals target-only text exactly (one-token steps ~1.5x slower there)",
    )
    kv_unified: Literal["auto", "on", "off"] = Field(
        "auto",
        description="on: one KV buffer shared by all sessions; off: one slice per session, so a session's numerics do"
        " not depend on the others (temperature-0 text under load equals the same request alone, on the CPU); auto:"
        " on when layers are offloaded to a GPU, where batched steps over per-session slices ran ~1.5x slower"
        " (8B on an H200) and GPU kernels differ by batch size anyway, off on the CPU",
    )

    def resolved_flash_attn(self, on_gpu: bool) -> bool:
        if self.flash_attn != "auto":
            return self.flash_attn == "on"
        return on_gpu or self.cache_type_v not in ("f32", "f16", "bf16")

    def resolved_kv_unified(self, on_gpu: bool) -> bool:
        return self.kv_unified == "on" or (self.kv_unified == "auto" and on_gpu)

    extra_buffers: bool = Field(
        False,
        description="let llama.cpp repack CPU weights into extra buffer types (AMX...); off because the AMX path of"
        " llama-cpp-python 0.3.36 segfaults on Sapphire Rapids CPUs",
    )
    session_idle_timeout_s: float = Field(300.0, gt=0, description="close sessions idle for longer than this")
    omp_spin_count: int = Field(
        10000,
        ge=-1,
        description="how long llama.cpp's OpenMP workers spin for the next forward pass before they sleep"
        " (GOMP_SPINCOUNT, set for the process unless the environment sets it; -1 = libgomp's default of 300,000)."
        " Spinning through a round trip to another process takes a core from it: on a 2-core CPU, 10,000 took the"
        " n-gram draft service's overhead from 8.5-11.1% to 7.9-9.8% of a round, with target-only decoding at"
        " 0.99-1.07x its speed (docs/benchmarks/cpu-2026-12-04-omp-spin-quiet). Less does not help: 1,000 was no"
        " better, and 0 made decoding 3.5x slower, since the count also governs every barrier inside a pass"
        " (docs/benchmarks/cpu-2026-12-05-omp-spin-low)",
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

    def resolved_threads(self) -> tuple[int, int]:
        n = self.n_threads or os.cpu_count() or 1
        return n, self.n_threads_batch or n


class ServiceSettings(EngineSettings):
    host: str = Field("127.0.0.1", description="address to listen on; anything but loopback is an explicit choice")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 = pick a free one and print it)")
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
        description="how long a step may wait for the calls the last step answered to come back, so that they stay"
        " in one batch (also at most half the last step's time; 0 = start at the first call)",
    )
    single_stream_inline: Literal["auto", "on", "off"] = Field(
        "auto",
        description="with one active session, run its steps on the serving thread itself instead of handing each"
        " call to the engine thread and back (saves 0.1-0.4 ms a call; other calls wait at most one step). auto: on"
        " for a GPU model or the n-gram drafter, off for a CPU model (llama.cpp's OpenMP keeps a worker pool per"
        " calling thread, and a second pool in the process slows every CPU forward pass, measured)",
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
        description="batched: verify all draft tokens in one forward pass (fast, logits differ slightly from one-token"
        " decoding); sequential: one pass per token (bit-identical to target-only decoding, k times the cost)",
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
    drafter: Literal["ngram", "model"] = Field("ngram", description="model: a small GGUF; ngram: prompt lookup")
    ngram_max: int = Field(NGRAM_MAX, ge=1, le=32, description="n-gram drafter: longest suffix to look up")
    ngram_min: int = Field(
        NGRAM_MIN, ge=1, le=32, description="n-gram drafter: shortest suffix to match (shorter matches draft noise)"
    )
    ngram_scaled: bool = Field(
        True,
        description="n-gram drafter: a suffix matched over m tokens drafts at most m - 1 tokens (off: always the"
        " full draft length)",
    )
    draft_support: int = Field(
        256, ge=1, le=4096, description="model drafter, sampling: tokens kept in the draft distribution it sends"
    )
    catch_up: Literal["stepwise", "batched"] = Field(
        "stepwise",
        description="model drafter: how its KV takes in the tokens of the last round it has not seen (after a fully"
        " accepted round: the last draft token and the target's own). stepwise: one token a pass, one-token numerics,"
        " so a same-model draft agrees with the target bit for bit, and on CUDA a one-token pass is the fast one (a"
        " 1B draft on an H200: ~1 ms against ~4.4 ms for two tokens in one pass); batched: one pass (a CPU draft's"
        " two-token pass costs less than two one-token passes)",
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
        description="draft by prompt lookup inside the gateway instead of calling a draft service (--draft is then"
        " not used): the same n-gram drafter as the service's, without a Propose RPC per round (~1 ms each on a small"
        " CPU box)",
    )
    local_ngram_min: int = Field(
        NGRAM_MIN,
        ge=1,
        le=32,
        description="--local-ngram: shortest suffix match that drafts. Longer minimums draft less often but only inside"
        " text that really repeats (llama-server's ngram-simple waits for 12 tokens); on the CPU build that also keeps"
        " batched verification from flipping near-ties in free prose",
    )
    local_ngram_max: int = Field(NGRAM_MAX, ge=1, le=32, description="--local-ngram: longest suffix to look up")
    target_lookup: bool = Field(
        True,
        description="--local-ngram with pipelined calls: between the gateway's own rounds, the target drafts with"
        " the gateway's lookup rule inside its target-only calls (VerifyItem.lookup), so a short draft costs no round"
        " trip of its own (two idle gaps at the target, ~3 ms a round on the 2-core CPU); used when the target's Info"
        " declares prompt_lookup",
    )
    continue_rounds: bool = Field(
        True,
        description="an n-gram draft service: a round whose drafts are likely to fail at once asks the target to go on"
        " decoding on its own after it, up to the next repeat the service could draft behind, in the same call"
        " (VerifyItem.plain_steps with drafts), instead of a second call sent behind it that the target skips whenever"
        " the round accepted a draft; used when the target's Info declares continues_rounds",
    )
    check_first_draft: Literal["auto", "always", "never"] = Field(
        "never",
        description="an n-gram draft service: check a round's first draft with a one-token step sent with the"
        " Propose and verify the rest behind it only if it held; saves verifying drafts that fail at once, at the cost"
        " of the first draft's place in a batched step and a message. auto: where the measured step costs and the"
        " request's acceptance say it pays (a second token in a step costing about as much as the first, as on CPUs;"
        " never on a GPU); always: every round. Not for seeded sampled requests with a fixed k (their random stream"
        " would change). On the 2-core CPU, auto made the service at a fixed k = 8 1.14-1.20x of target-only on json"
        " instead of 0.89-0.91x and 0.94-0.95x on chat instead of 0.87-0.91x, while with adaptive k it lost on up to"
        " three workloads (docs/benchmarks/cpu-2026-12-05-checked-rounds); off by default. The text at temperature 0"
        " can then follow the load (the step's shape flips near-ties)",
    )
    colocate: bool = Field(
        False,
        description="load the target (and, unless --draft is empty, the draft) into the gateway's own process and call"
        " them without gRPC, with their settings from the TANDEM_TARGET_* / TANDEM_DRAFT_* variables (--target and"
        " --draft addresses are then not used). For models on one host and one llama.cpp build: saves the ~2.4-3 ms"
        " of gRPC per speculative round measured on an H200 host",
    )
    model_name: str | None = Field(None, description="model id served on /v1/models (default: the target's name)")
    n_max: int | None = Field(
        None,
        ge=0,
        le=64,
        description="default draft tokens per round (0 = no speculation). Unset: 8 for a model drafter, 32 for an"
        " n-gram drafter, whose confidence rule sizes each draft itself (CPU benchmark, code edits: 1.87x at 32"
        " against 1.68x at 8, the other workloads within noise)",
    )
    n_min: int = Field(0, ge=0, le=64, description="drafts shorter than this are not verified")
    overlap_draft: bool = Field(
        False,
        description="model drafters: while the target verifies a round, the draft already drafts the next one as if"
        " every token will be accepted (kept when that holds, rewound when not). Turn it on when the draft runs on"
        " another device (the compose file and the chart do): on a shared device the two compete and it loses",
    )
    adaptive_k: bool = Field(
        True,
        description="choose each round's draft length in n_min..n_max from the measured cost of verification and"
        " the request's running acceptance (by match length for n-gram drafters, the gateway's and the draft"
        " service's; by draft position for a model drafter; fewer draft tokens when many requests share a step). On"
        " the CPU benchmark it is within 2% of the best fixed k on every workload for both drafters and beats the"
        " default k on average. Its choices follow measured timings, so a temperature-0 request can differ at a"
        " near-tie from one run to the next; seeded sampled requests keep a fixed k unless they ask for adaptive k",
    )
    plain_pipeline: int = Field(
        2,
        ge=1,
        le=4,
        description="target-only decoding: Verify calls kept in flight per request, so the target starts the next"
        " token without waiting a round trip for the gateway (1 = one at a time). Above 1, prompt lookup (the"
        " gateway's --local-ngram, or an n-gram draft service) sends the rounds between its drafts the same way, as"
        " calls the target ends at the next repeat the lookup could draft behind (1: a round, and for a draft"
        " service a Propose, per token there)",
    )
    plain_burst_ms: float = Field(
        100.0,
        ge=0,
        le=1000,
        description="target-only decoding: each Verify call asks for as many tokens as the target computes in this"
        " long (its measured step; at most 16), so that one message each way carries several tokens where steps are"
        " short; those tokens then reach the client together. 0: one token per call",
    )
    max_tokens_default: int = Field(512, ge=1, description="max_tokens when the request gives none")
    rpc_timeout_s: float = Field(30.0, gt=0, description="deadline of each gRPC call")
    startup_timeout_s: float = Field(600.0, gt=0, description="how long to wait for the services at start")
    upstream_tls_ca: Path | None = Field(None, description="PEM CA: talk TLS to the services, verifying them")
    upstream_tls_cert: Path | None = Field(None, description="PEM client certificate for mutual TLS")
    upstream_tls_key: Path | None = Field(None, description="PEM private key of --upstream-tls-cert")
    upstream_token: str | None = Field(None, description="shared token sent to the services (their --auth-token)")
    api_keys: list[str] = Field(
        default_factory=list,
        description='accepted Bearer keys (TANDEM_GATEWAY_API_KEYS=\'["k1","k2"]\'); empty = no authentication',
    )
    max_concurrent: int = Field(8, ge=1, description="requests generating at once (more wait in the queue)")
    max_queue: int = Field(64, ge=0, description="requests waiting for a slot; beyond this: 429 with Retry-After")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="largest request body accepted (413 above)")
    max_tokens_limit: int = Field(8192, ge=1, description="largest max_tokens a request may ask for")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @model_validator(mode="after")
    def _lookup_lengths_ordered(self) -> GatewaySettings:
        if self.local_ngram_min > self.local_ngram_max:
            raise ValueError(
                f"local_ngram_min ({self.local_ngram_min}) must not exceed local_ngram_max ({self.local_ngram_max})"
            )
        return self
