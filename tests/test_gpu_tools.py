"""The GPU bench's source patch (bench/gpu/cuda_graph_key.py): it rewrites exactly the function it knows, once, and
refuses a llama.cpp whose function has changed (a silent no-op would make an A/B compare two identical builds)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gpu.cuda_graph_key import FILE, ORIGINAL, PATCHED, patch


def _tree(tmp_path: Path, body: str) -> Path:
    path = tmp_path / FILE
    path.parent.mkdir(parents=True)
    path.write_text(f"#include <x>\n\nstatic int before;\n\n{body}\n\nstatic bool ggml_cuda_graph_update_required();\n")
    return tmp_path


def test_patch_rewrites_the_key_function_once(tmp_path: Path) -> None:
    root = _tree(tmp_path, ORIGINAL)
    assert patch(root) is True
    text = (root / FILE).read_text()
    assert PATCHED in text and ORIGINAL not in text
    assert text.startswith("#include <x>\n\nstatic int before;") and text.rstrip().endswith("update_required();")
    assert "mix((uint64_t) cgraph->nodes[0]->ne[i]);" in text and "last->ne[i]" in text  # shape is in the key
    assert patch(root) is False
    assert (root / FILE).read_text() == text


def test_patch_refuses_a_changed_function(tmp_path: Path) -> None:
    root = _tree(tmp_path, ORIGINAL.replace("return cgraph->nodes[0];", "return cgraph->nodes[1];"))
    with pytest.raises(SystemExit, match="not the function this patch expects"):
        patch(root)
