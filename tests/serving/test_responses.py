"""The rank response's scores array: byte-equal to msgspec's encoding of one dict per candidate."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from hstu.serving.responses import ScoresEncoder, encode_response


def reference(item_ids, probs, task_names) -> bytes:
    return msgspec.json.encode(
        [{"item_id": i, "scores": dict(zip(task_names, p))} for i, p in zip(list(item_ids), probs.tolist())]
    )


@pytest.mark.parametrize("candidates", [0, 1, 7, 300])
@pytest.mark.parametrize("task_names", [("click",), ("click", "like", "share"), ('quote"d', "ünï\\code")])
def test_scores_equal_the_per_candidate_dicts_byte_for_byte(candidates, task_names):
    rng = np.random.default_rng(candidates)
    item_ids = rng.integers(0, 2**62, candidates).tolist()
    probs = rng.random((candidates, len(task_names)), dtype=np.float32)
    probs[:1] = [0.0] * len(task_names) if candidates else probs[:1]  # exact zeros print as 0.0
    raw = ScoresEncoder(task_names)(item_ids, probs)
    assert bytes(raw) == reference(item_ids, probs, task_names)
    body = encode_response({"request_id": "r", "scores": raw, "cached_tokens": 3})
    assert json.loads(body)["scores"] == json.loads(reference(item_ids, probs, task_names))


def test_numpy_ids_and_wrong_shapes():
    encode = ScoresEncoder(["a", "b"])
    probs = np.array([[0.25, 0.5], [1.0, 0.125]], dtype=np.float32)
    assert bytes(encode(np.array([5, 6]), probs)) == reference([5, 6], probs, ["a", "b"])
    with pytest.raises(ValueError, match=r"probabilities of shape \(2, 2\) for 3 candidates and 2 tasks"):
        encode([1, 2, 3], probs)
    with pytest.raises(ValueError, match="at least one task name"):
        ScoresEncoder([])
