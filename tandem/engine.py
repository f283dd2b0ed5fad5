"""A thin wrapper over llama.cpp's C API (through llama-cpp-python's ctypes bindings).

Why not the high-level `llama_cpp.Llama`: it keeps one sequence and, for logits of every position, allocates
n_ctx x n_vocab floats. Speculative decoding needs many sequences in one context (one per session), logits of just
the positions being verified, and rollback of a sequence's KV cells past a rejected draft. This module gives exactly
that and nothing else; it knows nothing about gRPC or sessions.

Not thread-safe: the services call it from one worker thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import llama_cpp  # import before numpy: see shared notes (numpy first can crash model loading on some images)
import numpy as np

from tandem import __version__
from tandem.config import EngineSettings, graph_reuse, session_layout
from tandem.errors import ContextOverflow, EngineFailure, InvalidArgument
from tandem.models import resolve_model

log = logging.getLogger(__name__)
# llama.cpp logs through this logger (llama_cpp._logger); keep its chatter to errors unless asked for debug.
logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)

_GGML_TYPES = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "bf16": 30,
}
_FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
# Prefill chunks of fewer tokens are not timed (a prompt's tail), nor cut below it under load.
PREFILL_MEASURED_FROM = 32
OTHERS_STEPPING_NS = 200_000_000  # before a prefill's first chunk, a decode (no prefill) this recent: others step
_SPLIT_MODE = {"none": 0, "layer": 1, "row": 2}

_backend_ready = False


@dataclass(frozen=True)
class DecodeItem:
    """Tokens to append to one sequence, starting at KV position `start`.

    `logits` chooses which rows come back: "none", "last" (prefill) or "all" (verify).
    """

    seq_id: int
    tokens: Sequence[int]
    start: int
    logits: str = "last"


@dataclass(frozen=True)
class DeviceArgmax:
    """A greedy sequence's rows as llama.cpp's backend sampler left them: each row's argmax, computed where the logits
    are (on a GPU, no row of n_vocab floats is copied out nor scanned in numpy). Indexing gives a row's token."""

    tokens: np.ndarray  # int32, one per row

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> int:
        return int(self.tokens[i])


#: What decode returns for an item: its logits rows, or their argmaxes for a sequence with device argmax on.
Rows = np.ndarray | DeviceArgmax


def greedy_token(row: np.ndarray | int) -> int:
    """The greedy choice of one row: its argmax, or the token the device computed for it."""
    return row if isinstance(row, int) else int(row.argmax())


def meta_value(model: ctypes.c_void_p, key: str) -> str:
    """A string from the GGUF's metadata ("" where the key is absent)."""
    buf = ctypes.create_string_buffer(4096)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""


def token_piece(vocab: ctypes.c_void_p, token: int, special: bool) -> bytes:
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    if n < 0:
        buf = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, special)
    return buf.raw[:n]


def _special_id(token: int) -> int | None:
    return token if token >= 0 else None


def vocab_fingerprint(vocab: ctypes.c_void_p) -> str:
    """SHA-256 over every token's text (special tokens rendered) and the special ids: equal means the token ids of
    two models mean the same text, which is what speculative decoding needs (InfoResponse.vocab_fingerprint)."""
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    bos, eos = _special_id(llama_cpp.llama_vocab_bos(vocab)), _special_id(llama_cpp.llama_vocab_eos(vocab))
    eog = [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    h = hashlib.sha256()
    h.update(f"n_vocab={n_vocab};bos={bos};eos={eos};eog={eog};".encode())
    for t in range(n_vocab):
        piece = token_piece(vocab, t, special=True)
        h.update(len(piece).to_bytes(4, "little"))
        h.update(piece)
    return h.hexdigest()


_LOG_CALLBACK = None


def quiet_llama_logs() -> None:
    """Drop llama.cpp's own log lines (a vocabulary-only load prints ~100 lines of metadata) for a command's output."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def _detect_backend(settings: EngineSettings) -> tuple[str, str]:
    """Best-effort name of the backend the layers run on, and a device description."""
    threads, _ = settings.resolved_threads()
    if settings.n_gpu_layers == 0 or not llama_cpp.llama_supports_gpu_offload():
        return "CPU", f"CPU ({threads} threads)"
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    for name, marker in (("CUDA", "CUDA"), ("ROCm", "HIP"), ("ROCm", "ROCM"), ("Metal", "METAL"), ("Vulkan", "VULKAN")):
        if marker in info.upper():
            return name, f"{name}{settings.main_gpu} ({settings.n_gpu_layers} layers, split {settings.split_mode})"
    return "GPU", f"GPU{settings.main_gpu}"


_KV_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32}


def _kv_size(model, cells: int, settings: EngineSettings) -> str:
    """The KV cache's size for `cells` cells, from the model's shape (what the start-up log states)."""
    layers = llama_cpp.llama_model_n_layer(model)
    heads, kv_heads = llama_cpp.llama_model_n_head(model), llama_cpp.llama_model_n_head_kv(model)
    per_head = llama_cpp.llama_model_n_embd(model) // max(heads, 1)
    row = per_head * kv_heads * cells * layers
    total = row * (_KV_BYTES.get(settings.cache_type_k, 2.0) + _KV_BYTES.get(settings.cache_type_v, 2.0))
    return f"{total / 2**20:.0f} MiB"


def _joined(parts: list[Rows]) -> Rows:
    """An item's rows from the calls it took (an item longer than n_batch goes in several)."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], DeviceArgmax):
        return DeviceArgmax(np.concatenate([p.tokens for p in parts]))  # type: ignore[union-attr]
    return np.concatenate(parts)


class Engine:
    """One model, one context, many sequences (one per session)."""

    def __init__(self, settings: EngineSettings) -> None:
        global _backend_ready
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            _backend_ready = True
        self.settings = settings
        path = resolve_model(settings.model)
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        self.model_path = path
        t0 = time.perf_counter()
        log.info("loading model %s", path)
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = settings.n_gpu_layers if settings.n_gpu_layers >= 0 else 999
        mparams.main_gpu = settings.main_gpu
        mparams.split_mode = _SPLIT_MODE[settings.split_mode]
        mparams.use_extra_bufts = settings.extra_buffers
        self._model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise EngineFailure(f"llama.cpp could not load {path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)

        n_threads, n_threads_batch = settings.resolved_threads()
        self.max_sessions, n_ctx = session_layout(
            settings.n_ctx, settings.max_sessions, llama_cpp.llama_model_n_ctx_train(self._model)
        )
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = settings.n_batch
        cparams.n_ubatch = settings.n_batch
        cparams.n_seq_max = self.max_sessions
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads_batch
        self.backend, self.device = _detect_backend(settings)
        self.flash_attn = settings.resolved_flash_attn(on_gpu=self.backend != "CPU")
        cparams.flash_attn_type = _FLASH_ATTN["on" if self.flash_attn else "off"]
        cparams.type_k = _GGML_TYPES[settings.cache_type_k]
        cparams.type_v = _GGML_TYPES[settings.cache_type_v]
        # CPU default: a KV slice per session, so each session's numerics are independent of the others.
        cparams.kv_unified = settings.resolved_kv_unified(on_gpu=self.backend != "CPU")
        self.pack_steps = bool(cparams.kv_unified) and settings.resolved_pack_steps(on_gpu=self.backend != "CPU")
        cparams.no_perf = True
        self.device_argmax = settings.resolved_device_argmax(on_gpu=self.backend != "CPU")
        if self.device_argmax:  # a verify step wants k + 1 rows of one sequence; the default allows the sampler 1
            cparams.n_outputs_max_per_seq = 0
        with graph_reuse(allowed=not (self.pack_steps and self.backend != "CPU")):
            self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise EngineFailure("llama.cpp could not create a context (out of memory? try a smaller --n-ctx)")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self.n_ctx = llama_cpp.llama_n_ctx_seq(self._ctx)  # the context one session can use
        self.n_batch = settings.n_batch
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(self.n_batch,))
        self._nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(self.n_batch,))
        self._want = np.ctypeslib.as_array(self._batch.logits, shape=(self.n_batch,))
        self._nseq[:] = 1
        # Each row's seq_id pointer, fetched once: going through the batch struct costs two ctypes objects a token.
        self._seq_rows = [self._batch.seq_id[r] for r in range(self.n_batch)]
        self._logits_views: dict[tuple[int, int], np.ndarray] = {}  # (buffer address, rows) -> view of it
        self._argmax_chains: dict[int, ctypes.c_void_p] = {}  # seq_id -> its greedy sampler chain, while attached

        # The file name is what users recognise and pass as `model` (llama-server does the same).
        self.name = path.stem
        self.description = meta_value(self._model, "general.name")
        self.architecture = meta_value(self._model, "general.architecture")
        template = llama_cpp.llama_model_chat_template(self._model, None)
        self.chat_template = template.decode("utf-8", "replace") if template else ""
        self.pieces = [self._piece(t, special=False) for t in range(self.n_vocab)]
        self.eog_ids = [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t)]
        self._eog = set(self.eog_ids)
        bos = llama_cpp.llama_vocab_bos(self._vocab)
        eos = llama_cpp.llama_vocab_eos(self._vocab)
        self.bos_id = bos if bos >= 0 else None
        self.eos_id = eos if eos >= 0 else None
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self._vocab))
        self.bos_text = self._piece(bos, special=True).decode("utf-8", "replace") if bos >= 0 else ""
        self.eos_text = self._piece(eos, special=True).decode("utf-8", "replace") if eos >= 0 else ""
        self.fingerprint = self._fingerprint()
        self.version = f"tandem {__version__}; llama-cpp-python {llama_cpp.__version__}"
        self.forward_ns = 0  # cumulative time inside llama_decode, for per-call timing (callers read differences)
        # llama_decode calls; those whose batch layout changed from the call before, and their time (Load.reshaped_*)
        self.decode_calls = self.reshaped_calls = self.reshaped_ns = 0
        self._last_layout: tuple = ()
        # Prefill chunks while other sessions step (EngineSettings.prefill_chunk_ms): the budget, the measured prefill
        # time a token, and when a decode that was no prefill chunk last ran.
        self.prefill_chunk_ns = settings.prefill_chunk_ms * 1e6
        self.prefill_token_ns: float | None = None
        self._in_prefill = False
        self._other_step_at = -(10**18)
        if self.device_argmax:
            self._probe_device_argmax()
        log.info(
            "loaded %s (%s, vocab %d, %s) in %.1f s; %d session slots of %d tokens (training context %d), KV cache %s",
            self.name,
            self.architecture,
            self.n_vocab,
            self.device,
            time.perf_counter() - t0,
            self.max_sessions,
            self.n_ctx,
            llama_cpp.llama_model_n_ctx_train(self._model),
            _kv_size(self._model, self.n_ctx * self.max_sessions, settings),
        )

    # ------------------------------------------------------------------ vocabulary

    def _piece(self, token: int, special: bool) -> bytes:
        return token_piece(self._vocab, token, special)

    def _fingerprint(self) -> str:
        return vocab_fingerprint(self._vocab)

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def vocabulary_markup(self) -> tuple[dict[int, bytes], list[int]]:
        """Control tokens' markup (their piece is empty; a prompt spells them so) and the byte-fallback tokens: what
        a draft of another vocabulary needs besides the pieces (tandem.cross_vocab)."""
        markup: dict[int, bytes] = {}
        byte_tokens: list[int] = []
        for token in range(self.n_vocab):
            attr = llama_cpp.llama_vocab_get_attr(self._vocab, token)
            if attr & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL:
                markup[token] = self._piece(token, special=True)
            if attr & llama_cpp.LLAMA_TOKEN_ATTR_BYTE:
                byte_tokens.append(token)
        return markup, byte_tokens

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.pieces[t] for t in tokens).decode("utf-8", "replace")

    def check_tokens(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if not 0 <= t < self.n_vocab:
                raise InvalidArgument(f"token id {t} is outside the vocabulary (0..{self.n_vocab - 1})")

    # ------------------------------------------------------------------ KV cache

    def truncate(self, seq_id: int, position: int) -> None:
        """Drop KV cells of `seq_id` at positions >= `position` (rollback of rejected tokens)."""
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq_id, position, -1):
            raise EngineFailure(f"could not roll back sequence {seq_id} to {position}")

    def clear(self, seq_id: int) -> None:
        llama_cpp.llama_memory_seq_rm(self._memory, seq_id, 0, -1)

    # ------------------------------------------------------------------ forward passes

    def _probe_device_argmax(self) -> None:
        """One token through sequence 0 with the sampler attached: llama.cpp accepts a chain whose backend lacks the
        argmax operation and then neither samples nor copies logits, which would fail every greedy step later."""
        if not self.set_device_argmax(0, True):
            return
        try:
            self.decode([DecodeItem(0, [self.bos_id or 0], 0, "last")])  # no sampled token: EngineFailure
        except EngineFailure:
            self._turn_off_device_argmax()
        finally:
            self.set_device_argmax(0, False)
            self.clear(0)

    def _turn_off_device_argmax(self) -> None:
        log.warning("llama.cpp cannot take the argmax on %s: greedy rows are copied out", self.device)
        self.device_argmax = False

    def argmax_on(self, seq_id: int) -> bool:
        """Whether `seq_id`'s rows come back as device argmaxes."""
        return seq_id in self._argmax_chains

    def set_device_argmax(self, seq_id: int, on: bool) -> bool:
        """Whether `seq_id`'s rows come back as device argmaxes (DeviceArgmax) from now on; returns the state.

        For sessions that read nothing of a row but its argmax: greedy, no grammar, no logprobs. Attaching or
        detaching makes llama.cpp plan its graph again at the next decode, so a slot keeps its state until a session
        of the other kind takes it. Where the backend cannot run the sampler the engine turns the feature off.
        """
        on = on and self.device_argmax
        if on == (seq_id in self._argmax_chains):
            return on
        if not on:
            llama_cpp.llama_set_sampler(self._ctx, seq_id, None)
            llama_cpp.llama_sampler_free(self._argmax_chains.pop(seq_id))
            return False
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        if not llama_cpp.llama_set_sampler(self._ctx, seq_id, chain):
            llama_cpp.llama_sampler_free(chain)
            self._turn_off_device_argmax()
            return False
        self._argmax_chains[seq_id] = chain
        return True

    def decode(self, items: Sequence[DecodeItem], copy: bool = True) -> list[Rows]:
        """Run the items' tokens through the model, several sequences per llama_decode where they fit.

        Returns one float32 array per item: shape (len(tokens), n_vocab) for "all", (1, n_vocab) for "last",
        (0, n_vocab) for "none"; for a sequence with device argmax on (set_device_argmax), a DeviceArgmax of the
        wanted rows' tokens instead. With copy=False the arrays may be read-only views of llama.cpp's logits buffer,
        valid only until the next decode on this engine: a verify step reads a few rows of a long draft's block
        (33 rows of 49k logits cost ~0.5 ms to copy on the 2-core CPU) and needs none of them afterwards.
        """
        for item in items:
            self.check_tokens(item.tokens)
            if item.start + len(item.tokens) > self.n_ctx:
                raise ContextOverflow(
                    f"sequence of {item.start + len(item.tokens)} tokens exceeds the context size {self.n_ctx}"
                )
        out: list[list[Rows]] = [[] for _ in items]
        plan = self._plan(items)
        for part in plan:
            self._run(items, part, out, copy=copy or len(plan) > 1)  # a later call would overwrite the buffer
        if len(out) == 1 and len(out[0]) == 1:  # one item, one call: a speculative round's every decode
            return out[0]
        empty = np.zeros((0, self.n_vocab), np.float32)
        return [_joined(parts) if parts else empty for parts in out]

    def _plan(self, items: Sequence[DecodeItem]) -> list[list[tuple[int, int, int]]]:
        """Cut the items into llama_decode calls of (item, first token, token count) parts.

        With a KV slice per sequence, sequences in one call carry the same number of tokens: llama.cpp 0.3.36 then
        splits a batch into equal per-sequence ubatches, and when the counts differ the logits come out wrong (by up
        to ~1.2 on SmolLM2, measured; equal counts are bit-identical to decoding alone). So items are grouped by
        length, each group packed into calls of at most n_batch tokens, and an item longer than n_batch goes alone,
        in chunks. With one KV buffer (`kv_unified`, the GPU default) llama.cpp takes any mix of lengths in one
        ubatch, and `pack_steps` makes a step one call (decision 0021): the GPU default, with graph reuse off (0022).
        """
        if len(items) == 1 and 0 < len(items[0].tokens) <= self.n_batch:
            return [[(0, 0, len(items[0].tokens))]]

        # In seq_id order: llama.cpp 0.3.36 computes a batch whose sequences come out of order more slowly
        # (8 one-token sequences: 100 ms shuffled against 61 ms sorted, measured on SmolLM2, 2 CPU threads).
        def by_seq(members: list[int]) -> list[int]:
            return sorted(members, key=lambda i: items[i].seq_id)

        if self.pack_steps:
            return self._packed(items, by_seq([i for i, item in enumerate(items) if item.tokens]))
        by_length: dict[int, list[int]] = {}  # groups in the order their first item comes
        for i, item in enumerate(items):
            if item.tokens:
                by_length.setdefault(len(item.tokens), []).append(i)
        return [call for members in by_length.values() for call in self._packed(items, by_seq(members))]

    def _packed(self, items: Sequence[DecodeItem], order: list[int]) -> list[list[tuple[int, int, int]]]:
        """Items of any lengths (in `order`, distinct sequences) packed into calls of at most n_batch tokens; an item
        that does not fit the room left starts a new call, one longer than n_batch goes alone, in chunks."""
        plan: list[list[tuple[int, int, int]]] = []
        call: list[tuple[int, int, int]] = []
        room = self.n_batch
        for i in order:
            length = len(items[i].tokens)
            if length > self.n_batch:
                plan += [[(i, off, min(self.n_batch, length - off))] for off in range(0, length, self.n_batch)]
                continue
            if length > room:
                plan.append(call)
                call, room = [], self.n_batch
            call.append((i, 0, length))
            room -= length
        if call:
            plan.append(call)
        return plan

    def _run(
        self, items: Sequence[DecodeItem], part: list[tuple[int, int, int]], out: list[list[Rows]], copy: bool
    ) -> None:
        """One llama_decode over `part`; appends the wanted logits rows (copies, or views if not `copy`) to `out`."""
        r = 0
        wanted: list[tuple[int, int]] = []
        layout = tuple((items[i].seq_id, count, items[i].logits) for i, _, count in part)
        for i, off, count in part:
            item = items[i]
            for j in range(off, off + count):
                self._tok[r] = item.tokens[j]
                self._pos[r] = item.start + j
                self._seq_rows[r][0] = item.seq_id
                want = item.logits == "all" or (item.logits == "last" and j == len(item.tokens) - 1)
                self._want[r] = 1 if want else 0
                if want:
                    wanted.append((r, i))
                r += 1
        self._batch.n_tokens = r
        t0 = time.perf_counter_ns()
        rc = llama_cpp.llama_decode(self._ctx, self._batch)
        # llama_decode may return before the backend finishes: wait here so forward time is all the compute.
        llama_cpp.llama_synchronize(self._ctx)
        spent = time.perf_counter_ns() - t0
        self.forward_ns += spent
        self.decode_calls += 1
        if not self._in_prefill:
            self._other_step_at = time.monotonic_ns()
        if layout != self._last_layout:  # on CUDA such a call runs without a replayed graph (decision 0022)
            self.reshaped_calls += 1
            self.reshaped_ns += spent
            self._last_layout = layout
        if rc == 1:
            raise ContextOverflow("no free KV cells for this batch: too many tokens in flight, retry later")
        if rc != 0:
            raise EngineFailure(f"llama_decode failed with code {rc}")
        if not wanted:
            return
        # One copy of the whole output block: llama_get_logits returns the wanted rows in batch order, and each
        # item's rows are consecutive in it. (A numpy view per row through ctypes cost ~0.1 ms a call.) Where every
        # sequence of the batch has device argmax on, llama.cpp copies no logits out and only the tokens are read.
        n_out = len(wanted)
        block: np.ndarray | None = None
        first = 0
        for k in range(1, n_out + 1):
            if k == n_out or wanted[k][1] != wanted[first][1]:
                i = wanted[first][1]
                if items[i].seq_id in self._argmax_chains:
                    out[i].append(self._sampled(wanted[first:k]))
                else:
                    if block is None:
                        block = self._logits_block(n_out)
                        if copy:
                            block = block.copy()
                    out[i].append(block[first:k])
                first = k

    def _sampled(self, rows: Sequence[tuple[int, int]]) -> DeviceArgmax:
        """The backend sampler's tokens for these (batch row, item) outputs."""
        tokens = np.fromiter(
            (llama_cpp.llama_get_sampled_token_ith(self._ctx, r) for r, _ in rows), dtype=np.int32, count=len(rows)
        )
        if (tokens < 0).any():
            raise EngineFailure("llama.cpp returned no sampled token for a row with device argmax on")
        return DeviceArgmax(tokens)

    def _logits_block(self, n_out: int) -> np.ndarray:
        """A read-only view of the first n_out rows of llama.cpp's logits buffer.

        Views are kept per (address, rows): llama.cpp reuses its output buffer from step to step, and making a ctypes
        array type and a numpy view over it was the hottest Python line of a speculative round in a py-spy profile
        on the 2-core CPU."""
        address = ctypes.addressof(llama_cpp.llama_get_logits(self._ctx).contents)
        view = self._logits_views.get((address, n_out))
        if view is None:
            if len(self._logits_views) > 256:  # the buffer moved many times: forget old addresses
                self._logits_views.clear()
            buffer = (ctypes.c_float * (n_out * self.n_vocab)).from_address(address)
            view = np.frombuffer(buffer, dtype=np.float32).reshape(n_out, self.n_vocab)
            view.flags.writeable = False
            self._logits_views[(address, n_out)] = view
        return view

    def prefill_steps(self, items: Sequence[DecodeItem]) -> Generator[None, None, list[Rows]]:
        """Like decode, but at most n_batch tokens per forward pass and a `yield` between passes.

        Chunked prefill: the caller's scheduler runs other sessions' steps at each yield, so a long prompt does not
        stall running streams. Returns what decode would ("last" rows come from each item's final chunk).
        """
        done = [0] * len(items)
        out: list[Rows] = [np.zeros((0, self.n_vocab), np.float32) for _ in items]
        first = True
        last_chunk_end = time.monotonic_ns() - OTHERS_STEPPING_NS  # for the first chunk: a step this recently
        while True:
            if all(done[i] >= len(item.tokens) for i, item in enumerate(items)):
                return out
            if not first:
                yield  # other sessions' steps run here, and the next chunk's size depends on whether any did
            first = False
            chunk: list[tuple[int, DecodeItem]] = []
            room = self.prefill_chunk(others_since=last_chunk_end)
            for i, item in enumerate(items):
                left = len(item.tokens) - done[i]
                if left <= 0 or room <= 0:
                    continue
                n = min(room, left)
                final = done[i] + n == len(item.tokens)
                logits = item.logits if final or item.logits == "all" else "none"
                chunk.append(
                    (i, DecodeItem(item.seq_id, item.tokens[done[i] : done[i] + n], item.start + done[i], logits))
                )
                room -= n
            f0, self._in_prefill = self.forward_ns, True
            try:
                rows = self.decode([c for _, c in chunk])
            finally:
                self._in_prefill = False
                last_chunk_end = time.monotonic_ns()
            tokens = sum(len(c.tokens) for _, c in chunk)
            if tokens >= PREFILL_MEASURED_FROM:
                per_token = (self.forward_ns - f0) / tokens
                last = self.prefill_token_ns
                self.prefill_token_ns = per_token if last is None else last + 0.3 * (per_token - last)
            for (i, c), r in zip(chunk, rows, strict=True):
                done[i] += len(c.tokens)
                if len(r):
                    out[i] = _joined([out[i], r]) if items[i].logits == "all" and len(out[i]) else r

    def prefill_chunk(self, others_since: int) -> int:
        """Tokens in the next prefill chunk: n_batch, or, if other sessions stepped since `others_since` (monotonic
        ns: the prefill's last chunk, or OTHERS_STEPPING_NS before its first), what the measured prefill speed does in
        `prefill_chunk_ns`, at least PREFILL_MEASURED_FROM (twice that before any chunk was timed). Asking whether
        others stepped between this prefill's chunks, not whether any did lately, keeps a prompt sent right after
        another request ended in whole chunks."""
        if not self.prefill_chunk_ns or self._other_step_at <= others_since:
            return self.n_batch
        if self.prefill_token_ns is None:  # no prefill timed yet: a short chunk times one
            return min(self.n_batch, 2 * PREFILL_MEASURED_FROM)
        fits = int(self.prefill_chunk_ns / max(self.prefill_token_ns, 1.0))
        return max(PREFILL_MEASURED_FROM, min(self.n_batch, fits))

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            for seq_id in list(self._argmax_chains):
                self.set_device_argmax(seq_id, False)
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            llama_cpp.llama_model_free(self._model)
            self._ctx = None
