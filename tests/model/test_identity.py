"""Exact cache identity: near-collisions of arithmetic key schemes never reuse cached K/V.

Each case ranks a history (cached), then the same history with one past event changed plus new
events. The changed request must reuse nothing from the changed position on and its logits must
equal the no-cache model's. The cases are built to defeat arithmetic mixes of the fields: one
field +-1 compensated in another, timestamps shifted by 2^k (which wraps a multiply-by-4), values at
the int64 limit, item and action swapped, contextual features changed, weights changed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hstu.model.batch import RankingRequest
from hstu.model.identity import BLOCK_TOKENS, HistoryIdentity, token_records
from hstu.engine import RankingEngine
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager

MIX = 1_000_003
EVENTS = 24
INT64_MAX = 2**63 - 1


def _arithmetic_keys(contextual, items, actions, times) -> np.ndarray:
    """The per-token keys the cache used before exact identity (wrapping int64 arithmetic)."""
    with np.errstate(over="ignore"):
        ctx = contextual * 4
        it = (items * MIX + times) * 4 + 1
        ac = (actions * MIX + times) * 4 + 2
    return np.concatenate([ctx, np.stack([it, ac], axis=1).reshape(-1)])


def _base_history(rng: np.random.Generator, cfg, gap: int) -> dict:
    items = rng.integers(2, cfg.num_items - 2, EVENTS)
    actions = rng.integers(1, cfg.num_actions - 1, EVENTS)
    times = np.arange(1, EVENTS + 1, dtype=np.int64) * gap
    contextual = rng.integers(1, cfg.num_contextual_features - 1, cfg.num_contextual)
    return {"items": items, "actions": actions, "times": times, "contextual": contextual}


def _shift_times(h: dict, event: int, delta: int) -> dict:
    """Shift the timestamps of `event` and every later event (keeps them non-decreasing)."""
    times = h["times"].copy()
    times[event:] += delta
    return {**h, "times": times}


def _with(h: dict, field: str, event: int, value: int) -> dict:
    values = h[field].copy()
    values[event] = value
    return {**h, field: values}


def _near_collisions(cfg) -> list[tuple[str, dict, dict, int, bool]]:
    """(name, original, changed, first changed token, built against the old arithmetic mix)."""
    rng = np.random.default_rng(7)
    C = cfg.num_contextual
    item_tok = lambda e: C + 2 * e  # noqa: E731
    cases = []
    big = _base_history(rng, cfg, gap=2 * MIX)
    e = 5
    changed = _with(_with(big, "items", e, big["items"][e] + 1), "actions", e, big["actions"][e] + 1)
    changed = _shift_times(_shift_times(changed, e, -MIX), e + 1, MIX)  # only event e's timestamp moved
    cases.append(("item and action +1, timestamp -1_000_003", big, changed, item_tok(e), True))
    for k in (32, 40, 48, 56, 61, 62):
        h = _base_history(rng, cfg, gap=1_000)
        cases.append((f"timestamps +2^{k} from event 3", h, _shift_times(h, 3, 2**k), item_tok(3), k >= 62))
    h = _base_history(rng, cfg, gap=1_000)
    top = _shift_times(h, EVENTS - 4, INT64_MAX - int(h["times"][-1]))
    cases.append(("timestamps at the int64 limit", h, top, item_tok(EVENTS - 4), False))
    edge = _shift_times(h, 0, INT64_MAX - int(h["times"][-1]) - 1)
    cases.append(("int64 limit, last timestamp -1", edge, _shift_times(edge, EVENTS - 1, 1), item_tok(EVENTS - 1), False))
    h = _base_history(rng, cfg, gap=1_000)
    h = _with(_with(h, "items", 4, 1), "actions", 4, 2)
    cases.append(("item and action swapped", h, _with(_with(h, "items", 4, 2), "actions", 4, 1), item_tok(4), False))
    h = _base_history(rng, cfg, gap=1_000)
    swapped = _with(_with(h, "items", 6, h["items"][6] - 1), "items", 7, h["items"][7] + 1)
    cases.append(("item -1 here, +1 in the next event", h, swapped, item_tok(6), False))
    act = _with(_with(h, "actions", 2, h["actions"][2] + 1), "actions", 9, h["actions"][9] - 1)
    cases.append(("action +1 here, -1 later", h, act, item_tok(2) + 1, False))
    ctx = h["contextual"].copy()
    ctx[0] += 1
    cases.append(("contextual feature +1", h, {**h, "contextual": ctx}, 0, False))
    for i in range(8):  # seeded random near-collisions: +-1 in one field, -+1 in the other, a time shift
        h = _base_history(rng, cfg, gap=2**40)
        event = int(rng.integers(1, EVENTS - 2))
        delta = int(rng.choice([1, -1]))
        field, other = rng.permutation(["items", "actions"])
        changed = _with(h, str(field), event, int(h[field][event]) + delta)
        changed = _with(changed, str(other), event, int(h[other][event]) - delta)
        shift = int(rng.choice([0, 2**32, -(2**20)]))
        changed = _shift_times(_shift_times(changed, event, shift), event + 1, -shift)
        cases.append((f"random #{i}: {field} {delta:+d}, {other} {-delta:+d}, time {shift:+d}", h, changed, item_tok(event), False))
    return cases


def _request(cfg, user: int, h: dict, events: int, new: int = 0, seed: int = 0) -> RankingRequest:
    rng = np.random.default_rng(seed)
    items = np.concatenate([h["items"][:events], rng.integers(0, cfg.num_items, new)])
    actions = np.concatenate([h["actions"][:events], rng.integers(0, cfg.num_actions, new)])
    last = int(h["times"][events - 1])
    times = np.concatenate([h["times"][:events], np.full(new, last, dtype=np.int64)])
    return RankingRequest.create(user, items, actions, times, rng.integers(0, cfg.num_items, 3), h["contextual"], cfg)


def _model(cfg, manager=None, seed: int | None = None):
    cfg = dataclasses.replace(cfg, seed=cfg.seed if seed is None else seed)
    manager = manager or AsyncKVCacheManager(KVCacheConfig.for_model(cfg, page_size=4, num_pages=256, chunk_tokens=8))
    return RankingEngine(InferenceRankingGR(cfg), manager), manager


def _valid(cfg, h: dict) -> bool:
    in_range = all(
        (h[f] >= 0).all() and (h[f] < n).all() for f, n in (("items", cfg.num_items), ("actions", cfg.num_actions))
    )
    return in_range and (np.diff(h["times"]) >= 0).all() and (h["times"] >= 0).all()


NUM_CASES = 21


@pytest.mark.parametrize("prehashed", [False, True], ids=["records-compared", "digest-at-hand"])
@pytest.mark.parametrize("case", range(NUM_CASES))
@torch.inference_mode()
def test_a_changed_past_event_is_never_served_from_the_cache(tiny_config, case, prehashed):
    """Both ways the cache checks a GPU entry: the request's records against the entry's (a
    request hashed by nobody yet), and its digest (one a front end hashed already)."""
    cases = _near_collisions(tiny_config)
    assert len(cases) == NUM_CASES
    name, original, changed, first_changed, against_mix = cases[case]
    assert _valid(tiny_config, original) and _valid(tiny_config, changed), name
    if against_mix:
        old, new = (
            _arithmetic_keys(h["contextual"], h["items"], h["actions"], h["times"]) for h in (original, changed)
        )
        assert (old == new).all(), f"{name}: the construction should collide under the old arithmetic keys"
    model, mgr = _model(tiny_config)
    model.rank([_request(tiny_config, 1, original, EVENTS)])
    req = _request(tiny_config, 1, changed, EVENTS, new=2, seed=1)
    if prehashed:
        req.identity(model.model.identity).prefix(req.history_tokens(tiny_config))
    (out,) = model.rank([req])
    assert out.cached_tokens <= first_changed, f"{name}: reused {out.cached_tokens} tokens past {first_changed}"
    assert mgr.stats.snapshot()["invalidated_diverged"] == 1, name
    ref = model.forward_no_cache([req])
    torch.testing.assert_close(out.logits, ref, rtol=1e-5, atol=1e-6, msg=name)
    mgr.close()


def test_a_host_tier_prefix_is_checked_by_its_records_without_hashing_the_request(tiny_config, monkeypatch):
    """A user whose GPU entry went while its chunks stayed in the host tier: a request nobody hashed
    yet is checked byte for byte against the identity the entry was committed with (no hashing of
    its prefix); a past event changed inside that prefix is still found and the user recomputed."""
    from hstu.model import identity as identity_module

    h = _base_history(np.random.default_rng(3), tiny_config, gap=1_000)
    model, mgr = _model(tiny_config)
    model.rank([_request(tiny_config, 1, h, EVENTS)])
    mgr.drain()
    mgr.evict_gpu([1])
    host_len = len(mgr.host.lookup(1)[0]) * mgr.config.chunk_tokens
    assert host_len > 0
    req = _request(tiny_config, 1, h, EVENTS, new=2, seed=1)
    ident = req.identity(model.model.identity)
    real, hashed = identity_module._h, []
    monkeypatch.setattr(identity_module, "_h", lambda *parts: hashed.append(parts) or real(*parts))
    plan = mgr._lookup([1], [req.history_tokens(tiny_config)], [ident])
    mgr.host.unpin(list(plan.onload_slots))
    assert plan.sources == ["host"] and plan.cached_lens == [host_len]
    assert not hashed
    monkeypatch.undo()
    changed = _request(tiny_config, 1, _with(h, "items", 3, int(h["items"][3]) + 1), EVENTS, new=2, seed=1)
    (out,) = model.rank([changed])
    assert out.cached_tokens == 0 and mgr.stats.snapshot()["invalidated_diverged"] == 1
    torch.testing.assert_close(out.logits, model.forward_no_cache([changed]), rtol=1e-5, atol=1e-6)
    mgr.close()


def test_an_identity_is_forgotten_once_its_user_is_in_neither_tier(tiny_config):
    """Kept after a GPU eviction for the host chunks' lookup, dropped with the last tier's copy."""
    model, mgr = _model(tiny_config)
    h = _base_history(np.random.default_rng(4), tiny_config, gap=1_000)
    model.rank([_request(tiny_config, 1, h, EVENTS)])
    mgr.drain()
    mgr.evict_gpu([1])
    assert 1 in mgr._identities and mgr.host.contains(1)
    mgr.invalidate(1)
    assert 1 not in mgr._identities
    mgr.close()


def test_prefix_digests_are_chained_per_block_and_differ_between_tail_and_block():
    rng = np.random.default_rng(0)
    n_events = BLOCK_TOKENS + 7
    fields = [rng.integers(0, 100, 2), rng.integers(0, 100, n_events), rng.integers(0, 4, n_events), np.arange(n_events)]
    a = HistoryIdentity(b"model", token_records(*fields))
    b = HistoryIdentity(b"model", token_records(*fields))
    lengths = (0, 1, BLOCK_TOKENS - 1, BLOCK_TOKENS, BLOCK_TOKENS + 1, 2 * BLOCK_TOKENS, a.num_tokens)
    digests = [a.prefix(n) for n in lengths]
    assert digests == [b.prefix(n) for n in lengths], "the digest is a function of the inputs"
    assert len(set(digests)) == len(digests), "every prefix length has its own digest"
    assert HistoryIdentity(b"other model", token_records(*fields)).prefix(10) != a.prefix(10)
    with pytest.raises(ValueError, match=rf"prefix length {a.num_tokens + 1} outside"):
        a.prefix(a.num_tokens + 1)


def test_a_deferred_identity_builds_its_records_once_when_read_and_digests_as_an_eager_one():
    rng = np.random.default_rng(1)
    n_events = BLOCK_TOKENS + 7
    fields = [rng.integers(0, 100, 2), rng.integers(0, 100, n_events), rng.integers(0, 4, n_events), np.arange(n_events)]
    eager = HistoryIdentity(b"model", token_records(*fields))
    built = []
    deferred = HistoryIdentity.deferred(b"model", eager.num_tokens, lambda: built.append(1) or token_records(*fields))
    assert deferred.num_tokens == eager.num_tokens and not built, "nothing built before a read"
    assert deferred.prefix(eager.num_tokens) == eager.prefix(eager.num_tokens)
    assert deferred.shares_prefix(eager, eager.num_tokens) and (deferred.records == eager.records).all()
    assert built == [1], "built once"
    wrong = HistoryIdentity.deferred(b"model", 5, lambda: token_records(*fields))
    with pytest.raises(ValueError, match=rf"deferred records cover {eager.num_tokens} tokens, the identity 5"):
        wrong.prefix(5)


@torch.inference_mode()
def test_new_weights_on_a_shared_cache_recompute_instead_of_reusing_old_k_v(tiny_config):
    rng = np.random.default_rng(3)
    h = _base_history(rng, tiny_config, gap=100)
    old, mgr = _model(tiny_config)
    old.rank([_request(tiny_config, 9, h, EVENTS - 4)])
    new, _ = _model(tiny_config, manager=mgr, seed=123)
    req = _request(tiny_config, 9, h, EVENTS)
    (out,) = new.rank([req])
    assert out.cached_tokens == 0, "K/V computed by other weights must not be reused"
    torch.testing.assert_close(out.logits, new.forward_no_cache([req]), rtol=1e-5, atol=1e-6)
    new.model.load_state_dict(old.model.state_dict())
    (again,) = new.rank([_request(tiny_config, 9, h, EVENTS, new=1)])
    assert again.cached_tokens == 0, "a checkpoint load changes the model identity"
    mgr.close()


def test_request_arrays_are_read_only_copies(tiny_config):
    items = np.array([1, 2, 3])
    req = RankingRequest.create(1, items, [0, 1, 0], [5, 6, 7], [4], config=tiny_config)
    items[0] = 99
    assert req.item_ids[0] == 1
    with pytest.raises(ValueError, match="read-only"):
        req.item_ids[0] = 5


@pytest.mark.parametrize("kept", [0, 7, BLOCK_TOKENS, BLOCK_TOKENS + 3, 2 * BLOCK_TOKENS])
def test_an_extended_identity_equals_the_identity_of_the_whole_history(kept):
    rng = np.random.default_rng(kept)
    records = rng.integers(0, 2**40, (2 * BLOCK_TOKENS + 50, 2))
    held = HistoryIdentity(b"model", records[: 2 * BLOCK_TOKENS + 9])
    held.prefix(held.num_tokens)
    extended = held.extended(kept, records[kept:])
    whole = HistoryIdentity(b"model", records)
    assert extended.num_tokens == whole.num_tokens
    assert np.array_equal(extended.records, records)
    for length in (0, kept, BLOCK_TOKENS, whole.num_tokens - 1, whole.num_tokens):
        assert extended.prefix(length) == whole.prefix(length), length
    with pytest.raises(ValueError, match="prefix length"):
        held.extended(held.num_tokens + 1, records[:1])


def test_remembered_tail_digests_equal_fresh_ones_past_the_memo_bound():
    from hstu.model.identity import _MAX_TAILS, HistoryIdentity

    records = np.arange(2 * 1300, dtype=np.int64).reshape(-1, 2)
    ident = HistoryIdentity(b"m", records)
    lengths = [7 + 37 * i for i in range(3 * _MAX_TAILS)]
    first = [ident.prefix(n) for n in lengths]
    again = [ident.prefix(n) for n in lengths]
    fresh = [HistoryIdentity(b"m", records).prefix(n) for n in lengths]
    assert first == again == fresh and len(set(first)) == len(lengths)


def test_a_pickled_identity_brings_its_digests_and_hashes_nothing_again(monkeypatch):
    """The engine process gets the front end's identity with the whole history's digest already
    computed: its prepare worker does not hash the tail again."""
    import pickle

    from hstu.model import identity as identity_module

    records = np.arange(2 * 1300, dtype=np.int64).reshape(-1, 2)
    sent = HistoryIdentity(b"m", records)
    whole, part = sent.prefix(sent.num_tokens), sent.prefix(700)
    received = pickle.loads(pickle.dumps(sent))

    def no_hashing(*args):
        raise AssertionError("hashed again")

    monkeypatch.setattr(identity_module, "_h", no_hashing)
    assert received.prefix(received.num_tokens) == whole and received.prefix(700) == part
    with pytest.raises(AssertionError, match="hashed again"):
        received.prefix(701)  # a length nobody asked for yet


@pytest.mark.parametrize("length", [0, 5, BLOCK_TOKENS, BLOCK_TOKENS + 40, 2 * BLOCK_TOKENS + 9])
def test_a_shared_prefix_is_found_byte_for_byte_and_its_digests_are_adopted(length, monkeypatch):
    """The cache checks a GPU hit against the identity its entry was committed with by comparing
    records (no hashing); the adopted digests are the ones hashing would have given."""
    from hstu.model import identity as identity_module

    rng = np.random.default_rng(length)
    records = rng.integers(0, 2**40, (2 * BLOCK_TOKENS + 50, 2))
    stored = HistoryIdentity(b"model", records[: 2 * BLOCK_TOKENS + 9])
    stored.prefix(length)
    longer = HistoryIdentity(b"model", records)
    hashed = []
    monkeypatch.setattr(identity_module, "_h", lambda *parts: hashed.append(parts) or b"x" * 32)
    assert longer.shares_prefix(stored, length)
    assert not hashed and longer.prefix(length) == stored.prefix(length)
    monkeypatch.undo()
    assert longer.prefix(longer.num_tokens) == HistoryIdentity(b"model", records).prefix(longer.num_tokens)


def test_a_prefix_differing_in_one_field_or_in_the_model_is_not_shared():
    rng = np.random.default_rng(0)
    records = rng.integers(0, 2**40, (BLOCK_TOKENS + 50, 2))
    stored = HistoryIdentity(b"model", records)
    for row, col in ((0, 0), (BLOCK_TOKENS + 49, 1), (BLOCK_TOKENS, 0)):
        changed = records.copy()
        changed[row, col] ^= 1
        assert not HistoryIdentity(b"model", changed).shares_prefix(stored, BLOCK_TOKENS + 50), (row, col)
    later = records.copy()
    later[BLOCK_TOKENS + 10, 0] += 1
    assert HistoryIdentity(b"model", later).shares_prefix(stored, BLOCK_TOKENS + 10)
    assert not HistoryIdentity(b"other", records).shares_prefix(stored, 10)
    assert not HistoryIdentity(b"model", records[:20]).shares_prefix(stored, 21)


def test_token_records_lay_out_contextual_then_item_and_action_tokens():
    rec = token_records(np.array([7, 8]), np.array([1, 2]), np.array([0, 3]), np.array([50, 60]))
    assert rec.dtype == np.int64 and rec.tolist() == [[7, 0], [8, 0], [1, 50], [0, 50], [2, 60], [3, 60]]
    assert token_records(np.array([], dtype=np.int64), np.array([], dtype=np.int64), np.array([], dtype=np.int64),
                         np.array([], dtype=np.int64)).shape == (0, 2)


def test_same_bytes_compares_exactly_the_range_it_is_given():
    from hstu.ops._build import load_extension

    same = load_extension().same_bytes
    a = np.arange(64, dtype="<i8")
    b = a.copy()
    b[5] += 1  # byte 40 (the low byte, little-endian)
    va, vb = memoryview(a).cast("B"), memoryview(b).cast("B")
    assert same(va, vb, 0, 40) and same(va, vb, 48, 512) and same(va, vb, 40, 40)
    assert not same(va, vb, 0, 41) and not same(va, vb, 40, 41) and same(va, vb, 41, 512) and not same(va, vb, 0, 512)
    for start, stop in ((0, 513), (-1, 8), (9, 8)):
        with pytest.raises(ValueError, match="outside buffers"):
            same(va, vb, start, stop)
    with pytest.raises(ValueError, match="contiguous"):
        same(a[::2], b[::2], 0, 8)


@pytest.mark.parametrize("changed_token", [None, 10, 2 * BLOCK_TOKENS + 3], ids=["equal", "early block", "tail"])
def test_a_shared_prefix_of_two_hashed_identities_compares_block_digests_then_the_tail(changed_token, monkeypatch):
    """A request hashed by its front end against the identity a GPU entry was committed with:
    the block digests both hold stand for the whole blocks, the records past them are compared
    byte for byte; nothing is hashed, and a difference anywhere is found."""
    from hstu.model import identity as identity_module

    rng = np.random.default_rng(1)
    records = rng.integers(0, 2**40, (3 * BLOCK_TOKENS, 2))
    length = 2 * BLOCK_TOKENS + 40
    stored = HistoryIdentity(b"model", records[:length])
    stored.prefix(length)
    changed = records.copy()
    if changed_token is not None:
        changed[changed_token, 1] += 1
    request = HistoryIdentity(b"model", changed)
    request.prefix(request.num_tokens)
    monkeypatch.setattr(identity_module, "_h", lambda *parts: (_ for _ in ()).throw(AssertionError("hashed")))
    assert request.shares_prefix(stored, length) is (changed_token is None)
    if changed_token is None:
        assert request.prefix(length) == stored.prefix(length)  # adopted, not hashed


def test_an_identity_does_not_keep_the_one_it_shared_a_prefix_with_alive():
    """A GPU entry's identity is checked against the next request's, which is then committed in
    its place: the older one (and its records) must be freed, not chained to the newer."""
    import gc
    import weakref

    records = np.arange(2 * 3 * BLOCK_TOKENS, dtype=np.int64).reshape(-1, 2)
    older = HistoryIdentity(b"model", records[: 2 * BLOCK_TOKENS])
    older.prefix(older.num_tokens)
    newer = HistoryIdentity(b"model", records)
    assert newer.shares_prefix(older, older.num_tokens)
    assert newer.shares_prefix(older, older.num_tokens)  # the remembered match
    gone = weakref.ref(older)
    del older
    gc.collect()
    assert gone() is None
