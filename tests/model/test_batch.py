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

    def fail(*args):
        raise AssertionError("validated again")

    monkeypatch.setattr(batch_module, "_check_range", fail)
    received.validate(config_copy)  # no second check
    other = dataclasses.replace(tiny_config, num_items=tiny_config.num_items + 1)
    with pytest.raises(AssertionError, match="validated again"):
        received.validate(other)  # a different config is checked
