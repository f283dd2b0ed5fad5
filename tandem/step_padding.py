"""Padding a step's sequences to one token count, so that consecutive steps keep one shape (`--pad-steps`).

On CUDA llama.cpp replays a recorded graph only while consecutive llama_decode calls keep their shape; a call of
another shape runs kernel by kernel and the next one records the graph again. On one H100 (SmolLM2-135M target, four
streams, 2026-12-07) a call whose layout changed took 5.4 ms against 1.8-2.1 ms for the others, and with speculation
on such calls took 39-58% of the target's forward time against 8-20% off: a verify step of k + 1 tokens, then single
tokens, and one call per draft length within a step. Tokens themselves are nearly free there (one sequence of the
0.5B shape: 1.30 ms for 1 token, 1.62 ms for 5; decision 0021).

So a step's items are padded to the longest of them, each with copies of its last token after its own: the padding
sits after every real token of its sequence, so causal attention keeps it out of the real rows, and its KV cells are
dropped right after the call. Every item then asks for all its rows, so the call's output count holds too. The length
is kept for `hold` steps after the last item that needed it (a plain step padded to a verify's length costs a few
tokens; going back to single tokens costs a recorded graph, and the next verify another), then it falls to the step's
own longest item.

Only where every sequence of the step reads nothing but device argmaxes (greedy, `--device-argmax`): their rows are
then tokens computed on the device, and padding copies nothing out; a sequence whose logits are copied would copy a
vocabulary of floats for every padded row. Steps longer than `max_length` tokens an item (a prefill) are never padded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np


@dataclass
class StepPadding:
    """Which token count a step's items are padded to: the longest item's, held for `hold` steps after one needed it."""

    hold: int = 4
    max_length: int = 17  # a draft of 16 and its pending token
    logits_too: bool = False  # pad sequences whose logits are copied out too (tests compare their rows)
    length: int = 1  # the count steps are padded to now
    idle: int = 0  # steps since an item needed `length`

    def reset(self) -> None:
        """Back to unpadded steps (a padded step found no room in the KV cache)."""
        self.length, self.idle = 1, 0

    def length_for(self, lengths: Sequence[int]) -> int:
        """The token count for a step of items of these `lengths` (1: no padding), and the rule's state advanced."""
        longest = max(lengths, default=0)
        if longest > self.max_length or longest == 0:
            return 1  # a prefill chunk or an empty step: left alone, the held length kept for the steps around it
        if longest >= self.length:
            self.length, self.idle = longest, 0
        else:
            self.idle += 1
            if self.idle > self.hold:
                self.length, self.idle = longest, 0
        return self.length


@dataclass(frozen=True)
class Padded:
    """A step's items padded to one token count, and how to give each item back the rows it asked for."""

    items: list[Any]  # DecodeItem, padded, each asking for all its rows
    real: list[tuple[int, str]]  # per item: its own token count and the rows it asked for ("all", "last", "none")

    def rows(self, padded_rows: Sequence[Any], slicer: Callable[[Any, int, int], Any]) -> list[Any]:
        """Each item's own rows out of its padded rows (`slicer(rows, start, stop)`)."""
        out = []
        for rows, (n, logits) in zip(padded_rows, self.real, strict=True):
            if logits == "all":
                out.append(slicer(rows, 0, n))
            elif logits == "last":
                out.append(slicer(rows, n - 1, n))
            else:
                out.append(slicer(rows, 0, 0))
        return out


def pad_items(items: Sequence[Any], length: int) -> Padded:
    """The items with copies of their last token up to `length` tokens, each asking for all its rows."""
    padded = [
        replace(item, tokens=[*item.tokens, *[item.tokens[-1]] * (length - len(item.tokens))], logits="all")
        for item in items
    ]
    return Padded(padded, [(len(item.tokens), item.logits) for item in items])


def slice_rows(rows: Any, start: int, stop: int) -> Any:
    """Rows start..stop of an item's block: a logits array, or a DeviceArgmax (anything with `tokens`)."""
    if isinstance(rows, np.ndarray):
        return rows[start:stop]
    return type(rows)(rows.tokens[start:stop])
