"""`python -m bench.mask_cost MODEL.gguf [...]`: the cost of one grammar mask per verified token, per vocabulary.

Follows a JSON answer token by token under its schema (tandem.grammar, llguidance) and times, at each position, the
mask (compute + unpack) and applying it to one logits row: what a constrained Verify adds per position it verifies.
Prints one JSON line per model. See docs/decisions/0013.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp  # noqa: F401  (first: numpy before llama_cpp can break model loading on some images)
import numpy as np

from tandem.config import EngineSettings
from tandem.engine import Engine
from tandem.grammar import Constraint, GrammarState, tokenizer_for

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry", "notes"]}


def measure(path: str, passes: int = 5) -> dict:
    engine = Engine(EngineSettings(model=path, n_threads=1, max_sessions=1, n_ctx=512))
    t0 = time.perf_counter()
    tokenizer = tokenizer_for(engine)
    build_s = time.perf_counter() - t0
    ids = engine.tokenize(json.dumps(ANSWER), add_special=False, parse_special=False)
    grammar = Constraint("json_schema", json.dumps(SCHEMA)).grammar()
    row = np.random.default_rng(0).standard_normal(engine.n_vocab).astype(np.float32)
    mask_s, apply_s = [], []
    for _ in range(passes):
        state = GrammarState(tokenizer, grammar, engine.n_vocab)
        for token in ids:
            t0 = time.perf_counter()
            allowed = state.allowed()
            t1 = time.perf_counter()
            masked = row.copy()
            masked[~allowed] = -np.inf
            t2 = time.perf_counter()
            mask_s.append(t1 - t0)
            apply_s.append(t2 - t1)
            if not allowed[token]:
                raise SystemExit(f"the grammar forbids token {token} of the answer")
            state.take(token)
    engine.close()
    return {
        "model": engine.name,
        "n_vocab": engine.n_vocab,
        "tokenizer_build_s": round(build_s, 2),
        "tokens": len(ids) * passes,
        "mask_us_median": round(float(np.median(mask_s)) * 1e6, 1),
        "mask_us_p90": round(float(np.percentile(mask_s, 90)) * 1e6, 1),
        "apply_us_median": round(float(np.median(apply_s)) * 1e6, 1),
    }


def main() -> None:
    for path in sys.argv[1:]:
        print(json.dumps(measure(path)), flush=True)


if __name__ == "__main__":
    main()
