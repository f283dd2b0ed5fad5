"""`tandem-check-pair TARGET DRAFT` (or `make check-pair TARGET=... DRAFT=...`): can this draft serve this target?

Reads both GGUFs without their weights (paths, short names or `hf://` references, fetched as the services would) and
says whether their vocabularies are the same (the vocabulary fingerprint the gateway compares at start-up: token ids
mean the same text, so the draft's tokens can be verified as they are) or differ (the draft then drafts in text:
cross-vocabulary drafting, docs/decisions/0015), with each model's size and context. Exit status 0 for a pair tandem
serves (every pair of GGUFs today), 1 for one it refuses.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import llama_cpp

from tandem.engine import meta_value, quiet_llama_logs, vocab_fingerprint
from tandem.errors import EngineFailure
from tandem.models import resolve_model


@dataclass(frozen=True)
class ModelSummary:
    """What a GGUF says about itself, read without its weights."""

    path: str
    name: str
    architecture: str
    size_label: str
    context_length: int
    n_vocab: int
    fingerprint: str
    file_bytes: int


def read_summary(path: str) -> ModelSummary:
    """Load only the vocabulary and metadata of a GGUF (a fraction of a second even for a 40 GB file)."""
    mparams = llama_cpp.llama_model_default_params()
    mparams.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise EngineFailure(f"llama.cpp could not read {path}")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        arch = meta_value(model, "general.architecture")
        context = meta_value(model, f"{arch}.context_length")
        return ModelSummary(
            path=str(path),
            name=meta_value(model, "general.name") or str(path).rsplit("/", 1)[-1],
            architecture=arch,
            size_label=meta_value(model, "general.size_label"),
            context_length=int(context) if context.isdigit() else 0,
            n_vocab=llama_cpp.llama_vocab_n_tokens(vocab),
            fingerprint=vocab_fingerprint(vocab),
            file_bytes=os.path.getsize(path),
        )
    finally:
        llama_cpp.llama_model_free(model)


def describe(role: str, m: ModelSummary) -> str:
    size = f"{m.file_bytes / 2**30:.2f} GiB" if m.file_bytes >= 2**30 else f"{m.file_bytes / 2**20:.0f} MiB"
    label = f", {m.size_label}" if m.size_label else ""
    return (
        f"{role}: {m.name} ({m.architecture}{label}, {size}, context {m.context_length or '?'}, vocab {m.n_vocab}, "
        f"fingerprint {m.fingerprint[:12]})"
    )


def verdict(target: ModelSummary, draft: ModelSummary) -> tuple[bool, list[str]]:
    """(serves, lines of explanation)."""
    lines = []
    same = target.fingerprint == draft.fingerprint
    if same:
        lines.append("same vocabulary: the draft's token ids mean the target's text; tandem serves this pair")
    else:
        lines.append(
            "different vocabularies: tandem serves this pair by cross-vocabulary drafting (the draft proposes text, the"
            " target verifies its own tokens of it); a draft from the target's family accepts more, without translating"
        )
    ratio = target.file_bytes / max(draft.file_bytes, 1)
    lines.append(f"size ratio {ratio:.1f}x: the draft's step must cost well under the target's for drafting to pay")
    if ratio < 4:
        lines.append("  (under 4x: on one device a draft this large rarely pays; on its own device it may)")
    if draft.context_length and target.context_length and draft.context_length < target.context_length:
        lines.append(
            f"the draft's context ({draft.context_length}) is shorter than the target's ({target.context_length}):"
            " prompts longer than it are served target-only"
        )
    return True, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", help="target GGUF: a path, smollm2-135m, gemma3-270m or hf://OWNER/REPO/FILE.gguf")
    parser.add_argument("draft", help="draft GGUF, the same forms")
    args = parser.parse_args(argv)
    quiet_llama_logs()
    target = read_summary(str(resolve_model(args.target)))
    draft = read_summary(str(resolve_model(args.draft)))
    print(describe("target", target))
    print(describe("draft ", draft))
    serves, lines = verdict(target, draft)
    for line in lines:
        print(line)
    return 0 if serves else 1


if __name__ == "__main__":
    sys.exit(main())
