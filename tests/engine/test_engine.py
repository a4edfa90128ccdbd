"""The engine's short in-process API: `hstu.RankingEngine.create`, scores labelled by task, and
RankOutput's pickling."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import hstu
from hstu.engine import RankOutput
from tests.conftest import rel_err


def test_top_level_names_rank_with_labelled_scores(tiny_config, book):
    engine = hstu.RankingEngine.create(tiny_config, task_names=["click", "like", "share"], page_size=4, num_pages=64, chunk_tokens=8)
    for step in range(2):
        request = book.request(3, 4 + step)
        out = engine.rank([request])[0]
    by_task = out.scores_by_task()
    assert list(by_task) == ["click", "like", "share"]
    np.testing.assert_array_equal(np.stack(list(by_task.values()), axis=1), out.scores)
    assert out.cached_tokens > 0
    assert rel_err(out.logits, engine.forward_no_cache([request])) < 1e-5
    engine.cache.close()


def test_task_names_must_match_the_heads(tiny_config):
    with pytest.raises(ValueError, match=r"need 3 distinct task names, got \['a', 'a', 'b'\]"):
        hstu.RankingEngine.create(tiny_config, task_names=["a", "a", "b"])


def test_import_hstu_does_not_import_torch():
    code = "import sys, hstu; assert 'torch' not in sys.modules; hstu.HSTUConfig; assert 'torch' not in sys.modules; hstu.RankingEngine; assert 'torch' in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rank_output_pickles_only_its_logits_as_numpy(dtype):
    """Outputs cross processes (engine process, Ray replicas): a view of a batch's logits pickles
    its own values alone, with dtype and fields intact."""
    import pickle

    batch = torch.randn(40, 3).to(dtype)
    output = RankOutput(7, batch[10:15], 100, 20, ("click", "like", "share"))
    data = pickle.dumps(output)
    back = pickle.loads(data)
    assert back.logits.dtype == dtype and torch.equal(back.logits, output.logits)
    assert (back.user_id, back.cached_tokens, back.computed_tokens, back.task_names) == (7, 100, 20, ("click", "like", "share"))
    assert len(data) < 5 * 3 * 4 + 400  # not the batch's 40 rows
    assert np.allclose(back.scores, output.scores)


def test_rank_async_gives_the_outputs_of_rank_in_the_asked_dtype(tiny_config):
    """Off CUDA the launch is the whole forward; result() hands back rank()'s outputs, as float32
    when asked (what the server's completion thread reads)."""
    from tests.conftest import HistoryBook

    def engine():
        return hstu.RankingEngine.create(tiny_config, page_size=4, num_pages=64, chunk_tokens=8)

    sync, launched = engine(), engine()
    book_a, book_b = HistoryBook(tiny_config, seed=4), HistoryBook(tiny_config, seed=4)
    for step in range(3):
        users = [1, 2] if step % 2 else [2, 3, 4]
        expected = sync.rank([book_a.request(u, 3 + step) for u in users])
        pending = launched.rank_async([book_b.request(u, 3 + step) for u in users], dtype=torch.float64)
        assert pending.done()
        got = pending.result()
        assert [o.user_id for o in got] == users and all(o.logits.dtype == torch.float64 for o in got)
        for a, b in zip(expected, got):
            assert torch.equal(a.logits.double(), b.logits) and a.cached_tokens == b.cached_tokens
    sync.close()
    launched.close()


def test_an_unknown_logits_out_knob_is_refused_naming_it():
    import os
    import subprocess
    import sys

    env = {**os.environ, "HSTU_LOGITS_OUT": "dma"}
    proc = subprocess.run([sys.executable, "-c", "import hstu.engine.engine"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "HSTU_LOGITS_OUT must be one of copy, kernel; got 'dma'" in proc.stderr
