"""llama_cpp is imported before numpy and grpc in every process that loads a model.

On the CUDA image of the GPU machine, grpc (or numpy) loaded before llama_cpp makes llama.cpp segfault while loading
a model (2026-12-06, H100: `import grpc, llama_cpp` then Llama(SmolLM2) crashed; `import llama_cpp, grpc` loaded it).
tandem.config once imported tandem.ngram, and with it numpy, before `prepare_process` imported llama_cpp: the target
service crashed on that machine at model load. This CPU build does not crash either way, so the order is checked.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys
started = []  # top-level packages in the order their imports began (sys.modules holds them as they finished)
class Recorder:
    def find_spec(self, name, path=None, target=None):
        if name in ("llama_cpp", "numpy", "grpc"):
            started.append(name)
sys.meta_path.insert(0, Recorder())
import {entry}
from tandem.cli import parse_settings
from tandem.config import {settings}, prepare_process
prepare_process(parse_settings({settings}, {argv!r}), colocated={colocated})
print(",".join(started))
"""


@pytest.mark.parametrize(
    ("entry", "settings", "argv", "colocated"),
    [
        ("services.target.__main__", "TargetSettings", ["--model", "smollm2-135m"], False),
        ("services.draft.__main__", "DraftSettings", ["--drafter", "model", "--model", "smollm2-135m"], False),
        ("services.gateway.__main__", "TargetSettings", ["--model", "smollm2-135m"], True),
    ],
)
def test_llama_cpp_is_imported_first(entry: str, settings: str, argv: list[str], colocated: bool) -> None:
    code = PROBE.format(entry=entry, settings=settings, argv=argv, colocated=colocated)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    order = done.stdout.strip().splitlines()[-1].split(",")
    assert order[0] == "llama_cpp" and {"numpy", "grpc"} <= set(order), order
