"""HistoryStore: byte-bounded LRU of the histories the server answered."""

from __future__ import annotations

import numpy as np
import pytest

from hstu.model.identity import HistoryIdentity
from hstu.serving.history_store import HistoryStore


def identity(tokens: int) -> HistoryIdentity:
    ident = HistoryIdentity(b"model", np.arange(2 * tokens).reshape(tokens, 2))
    ident.prefix(tokens)
    return ident


def test_least_recently_used_users_are_evicted_to_stay_within_the_bytes():
    entry = HistoryStore.entry_bytes(identity(10))
    store = HistoryStore(3 * entry)
    for user in (1, 2, 3):
        store.put(user, identity(10))
    assert store.get(1) is not None  # 1 is now the most recent: 2 goes first
    store.put(4, identity(10))
    assert store.get(2) is None and store.get(1) is not None and store.get(4) is not None
    assert len(store) == 3 and store.nbytes == 3 * entry and store.evictions == 1


def test_a_users_new_history_replaces_the_old_one_and_its_bytes():
    store = HistoryStore(1 << 20)
    store.put(7, identity(10))
    longer = identity(40)
    store.put(7, longer)
    assert store.get(7) is longer and len(store) == 1 and store.nbytes == HistoryStore.entry_bytes(longer)
    store.discard(7)
    assert store.get(7) is None and store.nbytes == 0


def test_a_history_larger_than_the_store_is_not_kept_and_drops_the_users_older_one():
    store = HistoryStore(HistoryStore.entry_bytes(identity(10)))
    store.put(7, identity(10))
    store.put(7, identity(11))
    assert store.get(7) is None and store.nbytes == 0 and store.evictions == 0


def test_a_zero_byte_store_is_disabled_and_a_negative_one_is_refused():
    assert not HistoryStore(0).enabled
    with pytest.raises(ValueError, match="-1"):
        HistoryStore(-1)
