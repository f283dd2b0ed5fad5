"""`python -m bench.tie_margins`: how far batched verify rows' top-2 margins move from one-token decoding.

On real greedy text (two prompts of each temperature-0 workload, 160 tokens each, decoded one token at a time), each
stretch of positions is evaluated again inside a 9-token batch built on the same KV cells, as a verify step would, and
the top-2 margin (top logit minus the second) of each batch row is compared with the one-token row's. This sizes any
scheme that would re-decide near-ties with a one-token pass: its threshold must exceed these deviations.
"""

from __future__ import annotations

from tandem.engine import DecodeItem, Engine  # isort: skip  (llama_cpp before numpy, as in bench.exactness)
import numpy as np

from bench.workloads import workloads
from services.gateway.chat_template import ChatTemplate
from tandem.config import EngineSettings

BATCH = 9  # the pending token plus 8 drafts
TOKENS = 160


def top_and_margin(row: np.ndarray) -> tuple[int, float]:
    top = int(np.argmax(row))
    return top, float(row[top] - np.partition(row, -2)[-2])


def main() -> None:
    engine = Engine(EngineSettings(n_ctx=2048, max_sessions=1, prefix_cache=False))
    template = ChatTemplate(engine.chat_template)
    deviations: list[float] = []
    margins: list[float] = []
    flips = 0
    for workload in workloads(False):
        if workload.temperature != 0:
            continue
        for prompt in workload.prompts[:2]:
            rendered = template.render([{"role": "user", "content": prompt}])
            seq = engine.tokenize(rendered, add_special=False, parse_special=True)
            n0 = len(seq)
            engine.clear(0)
            (rows,) = engine.decode([DecodeItem(0, seq, 0, "last")])
            row, single = rows[-1], []
            for _ in range(TOKENS):  # target-only greedy decoding, one token per pass
                top, margin = top_and_margin(row)
                single.append((top, margin))
                seq.append(top)
                (rows,) = engine.decode([DecodeItem(0, [top], len(seq) - 1, "last")])
                row = rows[-1]
            margins += [m for _, m in single]
            for p in range(n0, n0 + TOKENS - BATCH, BATCH - 1):
                engine.truncate(0, p - 1)  # the batch recomputes cell p-1 (the pending token) onwards
                (batch,) = engine.decode([DecodeItem(0, seq[p - 1 : p - 1 + BATCH], p - 1, "all")])
                for j in range(BATCH):
                    (t1, m1), (t2, m2) = single[p - n0 + j], top_and_margin(batch[j])
                    deviations.append(abs(m1 - m2) if t1 == t2 else m1 + m2)
                    flips += t1 != t2
                engine.truncate(0, p - 1)  # back to one-token cells for the next stretch
                for q in range(p - 1, p - 1 + BATCH):
                    engine.decode([DecodeItem(0, [seq[q]], q, "none")])
    d, m = np.array(deviations), np.array(margins)
    print(
        f"batch rows {len(d)}, argmax flips {flips}; margin deviation: median {np.median(d):.4f},"
        f" p90 {np.percentile(d, 90):.4f}, p99 {np.percentile(d, 99):.4f}, max {d.max():.4f},"
        f" zero in {np.mean(d == 0):.1%}"
    )
    for eps in (0.1, 0.25, 0.5, 0.8):
        print(f"one-token margins below {eps}: {np.mean(m < eps):.1%} of {len(m)} positions")


if __name__ == "__main__":
    main()
