"""`python3 bench/gpu/cuda_graph_key.py LLAMA_CPP_DIR`: one CUDA graph per step shape in a llama.cpp source tree.

llama.cpp's CUDA backend (as vendored by llama-cpp-python 0.3.36) keys its cache of recorded CUDA graphs by the
address of a graph's first node, which is the same for every step of a context whatever its size. A step of another
size then overwrites the one recorded graph, and speculative decoding, whose steps change size all the time (verify,
plain and catch-up steps), mostly runs without replay: on one H100 a step whose size changed cost 1.2x (8B) to 1.9x
(0.5B) of a step of an unchanged size (decision 0021). Upstream this is llama.cpp issue #28652 (open; a fix keying by
the first node's extents, #28666, was closed unmerged). This script rewrites `ggml_cuda_graph_get_key` so that the key
also carries the node count and the first and last nodes' extents: each recurring shape keeps its own recorded graph.
Keyed by shape, a context can mint many graphs (a fork that keyed by topology saw 338 in one agent run, and its GPU
memory climbed until it aborted: ik_llama.cpp issue #2288), so the cache also keeps only the 32 used last, besides the
backend's own eviction of graphs unused for 10 s. For an A/B on the GPU only (`PATCH=1 bash bench/gpu/run.sh build`);
tandem's images build llama.cpp unpatched.
"""

from __future__ import annotations

import sys
from pathlib import Path

FILE = "ggml/src/ggml-cuda/ggml-cuda.cu"
ORIGINAL = """static const void * ggml_cuda_graph_get_key(ggml_cgraph * cgraph) {
    return cgraph->nodes[0];
}"""
PATCHED = """static const void * ggml_cuda_graph_get_key(ggml_cgraph * cgraph) {
    // tandem (bench/gpu/cuda_graph_key.py): one cached graph per shape, not one per context.
    uint64_t key = (uint64_t) (uintptr_t) cgraph->nodes[0];
    auto mix = [&key](uint64_t value) { key ^= value + 0x9e3779b97f4a7c15ULL + (key << 6) + (key >> 2); };
    mix((uint64_t) cgraph->n_nodes);
    const ggml_tensor * last = cgraph->nodes[cgraph->n_nodes - 1];
    for (int i = 0; i < GGML_MAX_DIMS; ++i) {
        mix((uint64_t) cgraph->nodes[0]->ne[i]);
        mix((uint64_t) last->ne[i]);
    }
    return (const void *) (uintptr_t) key;
}"""

CACHE_FILE = "ggml/src/ggml-cuda/common.cuh"
CACHE_ORIGINAL = """        auto it = cuda_graphs.find(first_node_ptr);
        if (it == cuda_graphs.end()) {
            it = cuda_graphs.emplace(first_node_ptr, std::make_unique<ggml_cuda_graph>()).first;
        }"""
CACHE_PATCHED = """        auto it = cuda_graphs.find(first_node_ptr);
        if (it == cuda_graphs.end()) {
            // tandem (bench/gpu/cuda_graph_key.py): keyed by shape, a context can mint many; keep the 32 used last.
            while (cuda_graphs.size() >= 32) {
                auto oldest = cuda_graphs.begin();
                for (auto jt = cuda_graphs.begin(); jt != cuda_graphs.end(); ++jt) {
                    if (jt->second->last_used_time < oldest->second->last_used_time) {
                        oldest = jt;
                    }
                }
                cuda_graphs.erase(oldest);
            }
            it = cuda_graphs.emplace(first_node_ptr, std::make_unique<ggml_cuda_graph>()).first;
        }"""

EDITS = ((FILE, ORIGINAL, PATCHED), (CACHE_FILE, CACHE_ORIGINAL, CACHE_PATCHED))


def patch(root: Path) -> bool:
    """Apply both edits under `root` (a llama.cpp tree); False if it was patched already. Checks both files before
    writing either, so a tree is never left half patched."""
    texts = {}
    for name, original, patched in EDITS:
        text = (root / name).read_text()
        if patched in text:
            texts[name] = None
        elif text.count(original) != 1:
            raise SystemExit(f"{root / name}: not the code this patch expects (llama.cpp changed?)")
        else:
            texts[name] = text.replace(original, patched)
    if all(t is None for t in texts.values()):
        return False
    if any(t is None for t in texts.values()):
        raise SystemExit(f"{root}: half patched already")
    for name, text in texts.items():
        (root / name).write_text(text)
    return True


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print("patched" if patch(Path(sys.argv[1])) else "already patched", sys.argv[1])
