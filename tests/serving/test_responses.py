"""The rank response's scores array: the per-candidate dicts' shape, each probability read back exactly."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from hstu.serving.responses import ScoresEncoder, encode_response


def decoded(raw) -> list[dict]:
    return json.loads(bytes(raw))


@pytest.mark.parametrize("candidates", [0, 1, 7, 300])
@pytest.mark.parametrize("task_names", [("click",), ("click", "like", "share"), ('quote"d', "ünï\\code")])
def test_scores_are_the_per_candidate_dicts_and_each_probability_reads_back_to_its_float32(candidates, task_names):
    rng = np.random.default_rng(candidates)
    item_ids = rng.integers(0, 2**62, candidates).tolist()
    probs = rng.random((candidates, len(task_names)), dtype=np.float32)
    if candidates > 1:
        probs[0] = 0.0  # an exact zero prints as a float, 0.0
        probs[-1, 0] = 3e-9  # a tiny one in exponent form
    raw = ScoresEncoder(task_names)(item_ids, probs)
    doc = decoded(raw)
    assert [c["item_id"] for c in doc] == item_ids
    assert all(list(c["scores"]) == list(task_names) for c in doc)
    got = np.array([[c["scores"][t] for t in task_names] for c in doc], dtype=np.float32).reshape(probs.shape)
    np.testing.assert_array_equal(got, probs)  # exact: the shortest float32 text round-trips
    assert all(isinstance(v, float) for c in doc for v in c["scores"].values())
    if candidates > 1:
        assert b'{"item_id":%d,"scores":{' % item_ids[0] in bytes(raw) and b":0.0" in bytes(raw)
    body = encode_response({"request_id": "r", "scores": raw, "cached_tokens": 3})
    assert json.loads(body)["scores"] == doc


def test_a_float32_is_written_as_float32_text_not_its_double_expansion():
    raw = bytes(ScoresEncoder(["p"])([1, 2, 3], np.array([[0.1], [1.0], [np.inf]], dtype=np.float32)))
    assert raw == b'[{"item_id":1,"scores":{"p":0.1}},{"item_id":2,"scores":{"p":1.0}},{"item_id":3,"scores":{"p":null}}]'
    double = bytes(ScoresEncoder(["p"])([4], np.array([[0.1]], dtype=np.float64)))
    assert re.search(rb'"p":0\.1}', double)


def test_numpy_ids_other_dtypes_and_wrong_shapes():
    encode = ScoresEncoder(["a", "b"])
    probs = np.array([[0.25, 0.5], [1.0, 0.125]], dtype=np.float32)
    assert decoded(encode(np.array([5, 6]), probs)) == [
        {"item_id": 5, "scores": {"a": 0.25, "b": 0.5}}, {"item_id": 6, "scores": {"a": 1.0, "b": 0.125}},
    ]
    assert decoded(encode([5, 6], probs.astype(np.float16))) == decoded(encode([5, 6], probs))
    assert decoded(encode([7], probs[:1].T.copy().T)) == decoded(encode([7], probs[:1]))  # any memory layout
    with pytest.raises(ValueError, match=r"probabilities of shape \(2, 2\) for 3 candidates and 2 tasks"):
        encode([1, 2, 3], probs)
    with pytest.raises(ValueError, match="at least one task name"):
        ScoresEncoder([])
