"""python draw_after_step.py: a sampled draw against the greedy argmax, right after each one-token forward pass.

Decodes 150 tokens of one prompt with the embedded model (the target's default settings); after every forward pass
it times either `sample_logits` at T = 0.7 (then once more on the same, now warm, row) or `np.argmax`, alternately.
"""

import statistics
import time

import numpy as np

from tandem.config import TargetSettings, prepare_process

settings = TargetSettings()
prepare_process(settings)  # llama_cpp first, as the services do

from tandem.engine import DecodeItem, Engine  # noqa: E402
from tandem.sampling import SamplingParams, sample_logits  # noqa: E402

engine = Engine(settings)
prompt = engine.tokenize("Write a short story about a lighthouse keeper who finds a message in a bottle.")
row = engine.decode([DecodeItem(0, prompt, 0, "last")])[0][-1]
rng = np.random.default_rng(1)
params = SamplingParams(temperature=0.7)
token, position = sample_logits(row, params, rng), len(prompt)
times: dict[str, list[int]] = {"forward pass": [], "sampled draw": [], "argmax": [], "sampled draw, warm row": []}
for i in range(150):
    t0 = time.perf_counter_ns()
    row = engine.decode([DecodeItem(0, [token], position, "last")], copy=False)[0][-1]
    times["forward pass"].append(time.perf_counter_ns() - t0)
    t0 = time.perf_counter_ns()
    if i % 2:
        token = sample_logits(row, params, rng)
        times["sampled draw"].append(time.perf_counter_ns() - t0)
        t0 = time.perf_counter_ns()
        sample_logits(row, params, rng)
        times["sampled draw, warm row"].append(time.perf_counter_ns() - t0)
    else:
        int(np.argmax(row))
        times["argmax"].append(time.perf_counter_ns() - t0)
        token = sample_logits(row, params, rng)
    position += 1
for name, values in times.items():
    print(f"{name:24s} median {statistics.median(values) / 1e3:8.1f} us over {len(values)}")
