"""The correctness oracle: logits with the cache equal the same model without it (fp32, 1e-5),
for many returning users, mixed batch sizes, GPU and host eviction, and concurrent clients."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from hstu.engine import RankingEngine
from hstu.model.ranking import InferenceRankingGR
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from tests.conftest import HistoryBook, rel_err


def _model(config, num_pages, host_chunks, prepare_worker=False, host_format="kv"):
    kv = KVCacheConfig.for_model(config, page_size=4, num_pages=num_pages, chunk_tokens=8)
    kv = KVCacheConfig.for_model(config, page_size=4, num_pages=num_pages, chunk_tokens=8,
                                 host_capacity_bytes=host_chunks * kv.chunk_bytes, prepare_worker=prepare_worker,
                                 host_format=host_format)
    mgr = AsyncKVCacheManager(kv)
    return RankingEngine(InferenceRankingGR(config), mgr), mgr


@pytest.mark.parametrize(
    "prepare_worker,host_format", [(True, "kv"), (False, "kv"), (False, "hidden")],
    ids=["prepare-worker", "prepare-inline", "hidden-host-chunks"],
)
def test_oracle_many_users_growing_histories_with_eviction(tiny_config, prepare_worker, host_format):
    model, mgr = _model(tiny_config, num_pages=96, host_chunks=250, prepare_worker=prepare_worker, host_format=host_format)
    book = HistoryBook(tiny_config, seed=1)
    rng = np.random.default_rng(2)
    rounds = {u: int(rng.integers(3, 6)) for u in range(60)}
    pending = [u for u, n in rounds.items() for _ in range(n)]
    rng.shuffle(pending)
    worst, requests_done = 0.0, 0
    while pending:
        size = int(rng.integers(1, 7))
        batch, rest = [], []
        for u in pending:
            (batch if len(batch) < size and u not in batch else rest).append(u)
        pending = rest
        reqs = [book.request(u, int(rng.integers(1, 9)), int(rng.integers(1, 6))) for u in batch]
        out = torch.cat([o.logits for o in model.rank(reqs)])
        worst = max(worst, rel_err(out, model.forward_no_cache(reqs)))
        requests_done += len(reqs)
    mgr.close()
    stats = mgr.stats.snapshot()
    assert worst < 1e-5, worst
    assert requests_done == sum(rounds.values())
    assert stats["gpu_evictions"] > 0 and stats["host_hits"] > 0 and stats["gpu_hits"] > 0
    assert stats["cached_tokens"] > stats["computed_tokens"] / 4
    assert (stats["hidden_chunks_onloaded"] > 0) == (host_format == "hidden")


def test_oracle_four_concurrent_clients_thousand_requests(tiny_config):
    """4 threads, each with its own users, so a user shows up in consecutive batches; the pools are
    small enough that both tiers evict."""
    model, mgr = _model(tiny_config, num_pages=170, host_chunks=300)
    total, threads_n = 1000, 4
    mismatches, errors, done = [], [], []
    lock = threading.Lock()

    def client(tid: int) -> None:
        book = HistoryBook(tiny_config, seed=100 + tid)
        rng = np.random.default_rng(tid)
        users = [tid * 100 + u for u in range(12)]
        sent = 0
        try:
            while sent < total // threads_n:
                size = min(int(rng.integers(1, 4)), total // threads_n - sent)
                chosen = rng.choice(users, size=size, replace=False)
                reqs = []
                for u in chosen:
                    if len(book.histories.get(int(u), ([],))[0]) > 100:
                        book.histories.pop(int(u))  # restart a long history: exercises invalidation
                    reqs.append(book.request(int(u), int(rng.integers(1, 6)), int(rng.integers(1, 4))))
                out = torch.cat([o.logits for o in model.rank(reqs)])
                err = rel_err(out, model.forward_no_cache(reqs))
                with lock:
                    done.append(len(reqs))
                    if err >= 1e-5:
                        mismatches.append(err)
                sent += len(reqs)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    mgr.close()
    assert not errors, errors
    assert sum(done) == total
    assert mismatches == []
    stats = mgr.stats.snapshot()
    assert stats["gpu_evictions"] > 0 and stats["host_evictions"] > 0 and stats["host_hits"] > 0, stats
