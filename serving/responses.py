"""The POST /v1/rank response body, encoded at wire speed.

Why: the scores array ([{"item_id": i, "scores": {task: p, ...}}, ...], the shape RankResponse
documents) was built as one dict per candidate and per task on the front end's event loop: on the
H200 host a py-spy profile of `hstu serve` under load put ~0.45 ms a request there, a third of the
loop's busy time (benchmarks/RESULTS.md, eleventh session). Here msgspec encodes each column (ids,
then each task's probabilities) as one JSON array in C; the arrays' items are then interleaved with
the constant keys by list slicing and joined once, so Python touches no candidate. The bytes equal
msgspec's encoding of the dicts (tests/serving/test_responses.py).
"""

from __future__ import annotations

from typing import Sequence

import msgspec
import numpy as np

_encode = msgspec.json.Encoder().encode


def _items(values: list) -> list[bytes]:
    """The JSON text of each number in `values` (numbers hold no comma)."""
    return _encode(values)[1:-1].split(b",")


class ScoresEncoder:
    """item ids + probabilities [M, len(task_names)] -> the "scores" JSON array, as msgspec.Raw."""

    def __init__(self, task_names: Sequence[str]) -> None:
        if not task_names:
            raise ValueError("a response needs at least one task name")
        keys = [_encode(str(name)) for name in task_names]
        # each candidate: {"item_id":<id>,"scores":{<key 0>:<p 0>,<key 1>:<p 1>,...}}
        self._separators = [b',"scores":{' + keys[0] + b":"] + [b"," + key + b":" for key in keys[1:]]
        self._width = 2 * len(keys) + 3  # per candidate: opening, id, (separator, probability) per task, closing

    def __call__(self, item_ids: Sequence[int], probs: np.ndarray) -> msgspec.Raw:
        m = len(item_ids)
        if probs.shape != (m, len(self._separators)):
            raise ValueError(f"probabilities of shape {probs.shape} for {m} candidates and {len(self._separators)} tasks")
        if m == 0:
            return msgspec.Raw(b"[]")
        width = self._width
        parts: list[bytes | None] = [None] * (m * width)
        parts[0::width] = [b',{"item_id":'] * m
        parts[0] = b'{"item_id":'
        parts[1::width] = _items(item_ids.tolist() if isinstance(item_ids, np.ndarray) else list(item_ids))
        for k, separator in enumerate(self._separators):
            parts[2 + 2 * k :: width] = [separator] * m
            parts[3 + 2 * k :: width] = _items(probs[:, k].tolist())
        parts[width - 1 :: width] = [b"}}"] * m
        return msgspec.Raw(b"[" + b"".join(parts) + b"]")


def encode_response(doc: dict) -> bytes:
    """JSON bytes of a response document (msgspec.Raw values are inserted as they are)."""
    return _encode(doc)
