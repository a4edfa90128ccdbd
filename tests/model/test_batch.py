"""RankingRequest: validation runs once per config, also across a pickle (the engine process)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from hstu.model import batch as batch_module
from hstu.model.batch import RankingRequest


def test_a_request_checked_by_the_front_end_is_not_checked_again_after_a_pickle(tiny_config, monkeypatch):
    request = RankingRequest.create(3, [1, 2], [0, 1], [5, 6], [4], config=tiny_config)
    received = pickle.loads(pickle.dumps(request))  # as the engine process gets it, with an equal config
    config_copy = pickle.loads(pickle.dumps(tiny_config))
    assert config_copy == tiny_config and config_copy is not tiny_config

    class Checks:
        @staticmethod
        def check_request(*args):
            raise AssertionError("validated again")

    monkeypatch.setattr(batch_module, "load_extension", Checks)
    received.validate(config_copy)  # no second check
    other = dataclasses.replace(tiny_config, num_items=tiny_config.num_items + 1)
    with pytest.raises(AssertionError, match="validated again"):
        received.validate(other)  # a different config is checked


@pytest.mark.parametrize(
    "change, message",
    [
        ({"item_ids": [1, 500, 2]}, r"user 3: item_ids value 500 out of range \[0, 500\)"),
        ({"candidates": [4, -2]}, r"user 3: candidates value -2 out of range \[0, 500\)"),
        ({"actions": [0, 1, 99]}, r"user 3: actions value 99 out of range \[0, 4\)"),
        ({"contextual": [1, 70]}, r"user 3: contextual value 70 out of range \[0, 50\)"),
        ({"timestamps": [5, 6, 2]}, r"user 3: timestamps must be non-decreasing, event 2 goes back in time"),
        ({"timestamps": [-9, -8, 2]}, r"user 3: timestamps must be >= 0, got -9"),
        ({"item_ids": [1, 500, 2], "actions": [0, 1, 99]}, r"item_ids value 500"),  # the first field checked
    ],
)
def test_an_invalid_value_is_named_with_its_field(tiny_config, change, message):
    fields = {"item_ids": [1, 2, 3], "actions": [0, 1, 2], "timestamps": [5, 6, 7], "candidates": [4], "contextual": [1, 2]}
    fields.update(change)
    with pytest.raises(ValueError, match=message):
        RankingRequest.create(3, config=tiny_config, **fields)
