"""`python -m bench.mask_cost MODEL.gguf [...]`: the cost of one grammar mask per verified token, per vocabulary.

Follows an answer token by token under its grammar (tandem.grammar, llguidance) and times, at each position, the mask
(compute + unpack) and applying it to one logits row: what a constrained Verify adds per position it verifies. Two
cases: a JSON answer under its schema (`response_format`), and a sentence then a tool call under the `tool_choice:
"auto"` grammar (free text until `<tool_call`, then the call's schema). Prints one JSON line per model and case. See
docs/decisions/0013.
"""

from __future__ import annotations

import json
import sys
import time

import llama_cpp  # noqa: F401  (first: numpy before llama_cpp can break model loading on some images)
import numpy as np

from services.gateway.tools import Tool, call_grammar
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
WEATHER = Tool(
    "get_weather",
    "Current weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
AUTO_ANSWER = (
    "Sure, I can help with that. The weather changes quickly in the mountains, so let me look it up for you.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)
CASES = {
    "json_schema": (lambda: Constraint("json_schema", json.dumps(SCHEMA)), json.dumps(ANSWER)),
    "tools_auto": (lambda: call_grammar("generic", [WEATHER], parallel=True, forced=False), AUTO_ANSWER),
}


def measure(path: str, passes: int = 5) -> list[dict]:
    engine = Engine(EngineSettings(model=path, n_threads=1, max_sessions=1, n_ctx=512))
    t0 = time.perf_counter()
    tokenizer = tokenizer_for(engine)
    build_s = time.perf_counter() - t0
    rows = [{**measure_case(engine, tokenizer, case, passes), "tokenizer_build_s": round(build_s, 2)} for case in CASES]
    engine.close()
    return rows


def measure_case(engine: Engine, tokenizer: object, case: str, passes: int) -> dict:
    make_constraint, answer = CASES[case]
    ids = engine.tokenize(answer, add_special=False, parse_special=False)
    grammar = make_constraint().grammar()
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
    return {
        "model": engine.name,
        "case": case,
        "n_vocab": engine.n_vocab,
        "tokens": len(ids) * passes,
        "mask_us_median": round(float(np.median(mask_s)) * 1e6, 1),
        "mask_us_p90": round(float(np.percentile(mask_s, 90)) * 1e6, 1),
        "apply_us_median": round(float(np.median(apply_s)) * 1e6, 1),
    }


def main() -> None:
    for path in sys.argv[1:]:
        for row in measure(path):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
