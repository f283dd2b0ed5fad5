"""The GPU bench's source patch (bench/gpu/cuda_graph_key.py): it rewrites exactly the code it knows, in both files,
once, and refuses a llama.cpp whose code has changed (a silent no-op would make an A/B compare two identical
builds) or a tree left half patched."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gpu.cuda_graph_key import CACHE_FILE, CACHE_ORIGINAL, CACHE_PATCHED, FILE, ORIGINAL, PATCHED, patch


def _tree(tmp_path: Path, key_body: str = ORIGINAL, cache_body: str = CACHE_ORIGINAL) -> Path:
    for name, body in ((FILE, key_body), (CACHE_FILE, cache_body)):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#include <x>\n\nstatic int before;\n\n{body}\n\nstatic bool after();\n")
    return tmp_path


def test_patch_rewrites_the_key_and_bounds_the_cache_once(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    assert patch(root) is True
    key, cache = (root / FILE).read_text(), (root / CACHE_FILE).read_text()
    assert PATCHED in key and ORIGINAL not in key and CACHE_PATCHED in cache
    for text in (key, cache):
        assert text.startswith("#include <x>\n\nstatic int before;") and text.rstrip().endswith("after();")
    assert "mix((uint64_t) cgraph->nodes[0]->ne[i]);" in key and "last->ne[i]" in key  # the shape is in the key
    assert "while (cuda_graphs.size() >= 32)" in cache  # and the cache keeps the graphs used last
    assert patch(root) is False
    assert (root / FILE).read_text() == key and (root / CACHE_FILE).read_text() == cache


def test_patch_refuses_changed_code_and_a_half_patched_tree(tmp_path: Path) -> None:
    changed = _tree(tmp_path / "a", key_body=ORIGINAL.replace("nodes[0];", "nodes[1];"))
    with pytest.raises(SystemExit, match="not the code this patch expects"):
        patch(changed)
    assert (changed / CACHE_FILE).read_text().count(CACHE_ORIGINAL) == 1  # nothing written
    half = _tree(tmp_path / "b", key_body=PATCHED)
    with pytest.raises(SystemExit, match="half patched"):
        patch(half)
