"""PageReuse: the earlier batch an onload waits for before overwriting its reserved pages."""

from __future__ import annotations

from hstu.ops.kvcache.page_reuse import ALL_EARLIER, PageReuse
from tests.ops.kvcache.test_manager import _check, _setup


class FakeEvent:
    """A compute event that completes when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _launch(reuse: PageReuse, users: list[int]) -> tuple[int, int, FakeEvent]:
    seq = reuse.begin()
    wait = reuse.reserved(seq, users)
    event = FakeEvent()
    reuse.launched(seq, event)
    return seq, wait, event


def test_pages_never_used_wait_for_nothing():
    reuse = PageReuse(cuda=True, waits_all=False)
    _, wait, _ = _launch(reuse, [1, 2])
    assert wait == -1 and reuse.wait_for(wait) is None


def test_an_evicted_users_pages_wait_for_its_last_batch_only_while_it_runs():
    reuse = PageReuse(cuda=True, waits_all=False)
    first, _, first_done = _launch(reuse, [1])
    _launch(reuse, [2])
    reuse.freed(1)  # user 1 evicted: its pages may go to the next batch
    seq = reuse.begin()
    wait = reuse.reserved(seq, [3])
    assert wait == first and reuse.wait_for(wait) is first_done
    first_done.done = True
    reuse.launched(seq, FakeEvent())  # drops the completed batches in front
    assert reuse.wait_for(first) is None


def test_a_users_own_resized_pages_wait_for_its_last_batch():
    reuse = PageReuse(cuda=True, waits_all=False)
    first, _, _ = _launch(reuse, [1])
    seq = reuse.begin()
    assert reuse.reserved(seq, [1, 5]) == first
    assert reuse.reserved(reuse.begin(), [6]) == -1  # nothing freed, users of their own


def test_freed_pages_keep_the_latest_user_batch():
    reuse = PageReuse(cuda=True, waits_all=False)
    a, _, _ = _launch(reuse, [1])
    b, _, _ = _launch(reuse, [2])
    reuse.freed(2)
    reuse.freed(1)
    assert reuse.reserved(reuse.begin(), [9]) == b  # covers a: one compute stream, in order


def test_unknown_or_knob_waits_for_all_and_no_cuda_waits_for_nothing():
    reuse = PageReuse(cuda=True, waits_all=False)
    _launch(reuse, [1])
    seq = reuse.begin()
    reuse.reserved(seq, [2])
    _launch(reuse, [3])
    assert reuse.wait_for(seq) is ALL_EARLIER  # no event of its own between two that have one
    assert reuse.wait_for(seq - 1) is not None
    assert PageReuse(cuda=True, waits_all=True).wait_for(-1) is ALL_EARLIER
    assert PageReuse(cuda=False, waits_all=False).wait_for(3) is None


def test_an_onload_into_an_evicted_users_pages_names_that_users_batch(tiny_config, book):
    """Through the manager: user 1's onload gets the pages of user 2, evicted to make room, so it
    waits for user 2's last batch; a batch whose pages were never used waits for none."""
    model, mgr = _setup(tiny_config, num_pages=12)
    _check(model, [book.request(1, 12)])
    mgr.drain()
    first_seq = mgr._reuse._next - 1
    mgr.evict_gpu([1])
    _check(model, [book.request(2, 12)])  # takes user 1's freed pages (user 1's batch: first_seq)
    mgr.drain()
    seq_2 = mgr._reuse._next - 1
    plan = mgr.plan([1], [tiny_config.history_tokens(14)], [book.request(1, 2).identity(model.model.identity)], [3])
    try:
        assert plan.sources == ["host"] and plan.reuse_wait == seq_2  # user 2 evicted for user 1's onload
    finally:
        mgr.abort(plan)
    assert first_seq < seq_2


def test_an_aborted_batchs_users_count_as_handed_back(tiny_config, book):
    """An aborted batch's users keep the pages reserved for it beyond their committed length (all of
    them, for a new user). A later reserve may shrink such an entry, or a prefetch drop an empty
    one, into the free list with no eviction to note: every later onload waits for that batch."""
    model, mgr = _setup(tiny_config, num_pages=12)
    request = book.request(1, 12)
    plan = mgr.plan([1], [request.history_tokens(tiny_config)], [request.identity(model.model.identity)], [3])
    aborted = plan.seq
    mgr.abort(plan)
    assert mgr._reuse.reserved(mgr._reuse.begin(), [7]) == aborted
