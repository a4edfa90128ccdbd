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


def test_a_copy_for_another_user_stays_validated_but_is_hashed_afresh(tiny_config, monkeypatch):
    request = RankingRequest.create(3, [1, 2], [0, 1], [5, 6], [4], config=tiny_config)
    model_id = b"m" * 32
    request.identity(model_id)

    class Checks:
        @staticmethod
        def check_request(*args):
            raise AssertionError("validated again")

    monkeypatch.setattr(batch_module, "load_extension", Checks)
    copy = request.for_user(11)
    assert copy.user_id == 11 and copy.item_ids is request.item_ids
    copy.validate(tiny_config)  # no second check: nothing validated depends on the id but its sign
    assert not copy._identities  # its digests are computed when it is ranked, as a new request's
    with pytest.raises(ValueError, match="user_id must be >= 0, got -1"):
        request.for_user(-1).validate(tiny_config)


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


def test_a_pickled_request_brings_its_digests_and_rebuilds_its_records(tiny_config, monkeypatch):
    """The engine process gets the front end's digests (nothing is hashed again) without the token
    records, which it rebuilds from the arrays: the pickle is about the arrays' size, not twice it."""
    import numpy as np

    from hstu.model import identity as identity_module

    n = 120
    request = RankingRequest.create(3, np.arange(n) % 400, np.arange(n) % 4, np.arange(n), [4], config=tiny_config)
    model_id = b"m" * 32
    sent = request.identity(model_id)
    whole, part = sent.prefix(sent.num_tokens), sent.prefix(101)
    data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
    arrays = sum(getattr(request, f).nbytes for f in ("item_ids", "actions", "timestamps", "candidates", "contextual"))
    assert len(data) < arrays + 2_000  # the records (16 bytes a token) are not in it

    monkeypatch.setattr(identity_module, "_h", lambda *a: (_ for _ in ()).throw(AssertionError("hashed again")))
    received = pickle.loads(data)
    ident = received.identity(model_id)
    assert bytes(ident.records) == bytes(sent.records)
    assert ident.prefix(ident.num_tokens) == whole and ident.prefix(101) == part
    assert not received.item_ids.flags.writeable


def test_restoring_an_identity_over_records_of_another_length_is_refused():
    import numpy as np

    from hstu.model.identity import HistoryIdentity

    ident = HistoryIdentity(b"m", np.zeros((10, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="records cover 9 tokens, the digests 10"):
        HistoryIdentity.restored(np.zeros((9, 2), dtype=np.int64), *ident.digests())
