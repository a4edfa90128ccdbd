"""The POST /v1/rank response body, encoded at wire speed.

Why: the scores array ([{"item_id": i, "scores": {task: p, ...}}, ...], the shape RankResponse
documents) was built as one dict per candidate and per task on the front end's event loop: on the
H200 host a py-spy profile of `hstu serve` under load put ~0.45 ms a request there, a third of the
loop's busy time (benchmarks/RESULTS.md, eleventh session). Then msgspec encoded each column and
Python interleaved the items with the keys by list slicing (~75 us for 256 candidates x 3 tasks on
the dev CPU, the server's "respond" phase at 0.32-0.35 ms p50 on the H100 host). Now one C++ pass
writes the array (csrc/response_json.cpp) from the ids and the probabilities, the task keys
JSON-encoded here once. A probability is the shortest text of its own float type (a float32 as
float32), so it parses back to exactly the value the model produced.
"""

from __future__ import annotations

from typing import Sequence

import msgspec
import numpy as np

from hstu.ops._build import load_extension

_encode = msgspec.json.Encoder().encode


class ScoresEncoder:
    """item ids + probabilities [M, len(task_names)] -> the "scores" JSON array, as msgspec.Raw."""

    def __init__(self, task_names: Sequence[str]) -> None:
        if not task_names:
            raise ValueError("a response needs at least one task name")
        keys = [_encode(str(name)) for name in task_names]
        # each candidate: {"item_id":<id>,"scores":{<key 0>:<p 0>,<key 1>:<p 1>,...}}
        self._separators = [b',"scores":{' + keys[0] + b":"] + [b"," + key + b":" for key in keys[1:]]
        self._ext = load_extension()

    def __call__(self, item_ids: Sequence[int], probs: np.ndarray) -> msgspec.Raw:
        m = len(item_ids)
        if probs.shape != (m, len(self._separators)):
            raise ValueError(f"probabilities of shape {probs.shape} for {m} candidates and {len(self._separators)} tasks")
        if probs.dtype not in (np.float32, np.float64):
            probs = probs.astype(np.float64)
        ids = np.ascontiguousarray(item_ids, dtype=np.int64)
        return msgspec.Raw(self._ext.encode_scores(ids, np.ascontiguousarray(probs), self._separators))


def encode_response(doc: dict) -> bytes:
    """JSON bytes of a response document (msgspec.Raw values are inserted as they are)."""
    return _encode(doc)
