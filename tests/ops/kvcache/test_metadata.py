"""KVCacheMetadata: from_pages packs every array into one host buffer that `to` moves whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hstu.ops.kvcache.layout import JaggedLayout
from hstu.ops.kvcache.metadata import KVCacheMetadata


def _meta(history: list[int], cached: list[int], candidates: list[int], page_size: int = 4) -> KVCacheMetadata:
    layout = JaggedLayout.build(history, cached, candidates)
    pages, next_page = [], 0
    for h in history:
        n = -(-h // page_size)
        pages.append(list(range(next_page, next_page + n)))
        next_page += n
    return KVCacheMetadata.from_layout(pages, layout, page_size)


def test_every_field_is_an_aligned_view_into_one_buffer():
    meta = _meta([9, 5, 3], [4, 0, 0], [2, 1, 3])
    buffer, _ = meta.packed
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    for name, t in meta.tensors().items():
        assert t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr(), name
        assert start <= t.data_ptr() and t.data_ptr() + t.nbytes <= end, name
        assert (t.data_ptr() - start) % 16 == 0 and start % 16 == 0, name  # Triton specialises on it
    assert meta.page_table.tolist() == [[0, 1, 2], [3, 4, 3], [5, 5, 5]]
    assert meta.q_pos.dtype == torch.int64 and meta.append_page_ids.dtype == torch.int32
    assert meta.append_page_ids.tolist() == [1, 1, 1, 1, 2, 3, 3, 3, 3, 4, 5, 5, 5]
    assert meta.max_q == 7


def test_to_moves_the_buffer_and_keeps_every_value_dtype_and_shape():
    meta = _meta([9, 1], [9, 0], [3, 2])  # user 0 has no new history tokens: empty-ish arrays
    moved = meta.to("cpu")
    assert moved.packed is not None and moved.max_q == meta.max_q
    for name, t in meta.tensors().items():
        m = moved.tensors()[name]
        assert m.dtype == t.dtype and m.shape == t.shape and torch.equal(m, t), name


def test_metadata_built_field_by_field_still_moves():
    meta = _meta([5], [0], [1])
    plain = KVCacheMetadata(**{k: v.clone() for k, v in meta.tensors().items()}, max_q=meta.max_q)
    moved = plain.to("cpu")
    assert moved.packed is None
    assert all(torch.equal(moved.tensors()[k], v) for k, v in meta.tensors().items())


def test_padded_metadata_holds_the_unpadded_values_then_each_fields_padding_rule():
    from hstu.ops.kvcache.metadata import _PADDING, PadSpec

    layout = JaggedLayout.build([9, 5, 3], [4, 0, 0], [2, 1, 3])
    pages = [[0, 1, 2], [3, 4], [5]]
    plain = KVCacheMetadata.from_layout(pages, layout, 4)
    spec = PadSpec(rows=24, max_batch=5, max_pages=4, scratch_page=77)
    padded = KVCacheMetadata.from_layout(pages, layout, 4, pad=spec)
    assert padded.max_q == 24 and padded.page_table.shape == (5, 4)
    assert padded.page_table[:3, :3].tolist() == [[0, 1, 2], [3, 4, 77], [5, 77, 77]]
    assert (padded.page_table[3:] == 77).all()
    for name, t in plain.tensors().items():
        if name == "page_table":
            continue
        p, n = padded.tensors()[name], t.shape[0]
        assert torch.equal(p[:n], t), name
        fill = _PADDING[name]
        rest = p[n:]
        if fill == "scratch":
            assert (rest == 77).all(), name
        elif fill == "last":
            assert (rest == t[-1]).all(), name
        elif fill == "row":
            assert rest.tolist() == list(range(n, p.shape[0])), name
        else:
            assert (rest == fill).all(), name


def test_a_page_list_that_does_not_cover_its_history_is_rejected():
    layout = JaggedLayout.build([9, 5], [0, 0], [1, 1])
    with pytest.raises(ValueError, match="user 1: 1 pages cannot hold exactly 5 tokens"):
        KVCacheMetadata.from_layout([[0, 1, 2], [3]], layout, 4)


def _expected_fields(history: list[int], cached: list[int], candidates: list[int], pages: list[list[int]], ps: int):
    """Every unpadded field read off the JaggedLayout's rows, user by user."""
    layout = JaggedLayout.build(history, cached, candidates)
    append_pos = layout.q_pos[layout.history_rows]
    width = max(len(p) for p in pages)
    return {
        "page_table": [p + [p[0]] * (width - len(p)) for p in pages],
        "page_indices": [x for p in pages for x in p],
        "page_indptr": np.concatenate([[0], np.cumsum([len(p) for p in pages])]).tolist(),
        "last_page_len": [h - (len(p) - 1) * ps for h, p in zip(history, pages)],
        "kv_lens": history,
        "cached_lens": cached,
        "q_offsets": layout.q_offsets.tolist(),
        "q_batch": layout.q_batch.tolist(),
        "q_local": layout.q_local.tolist(),
        "q_pos": layout.q_pos.tolist(),
        "append_rows": layout.history_rows.tolist(),
        "append_page_ids": [pages[b][pos // ps] for b, pos in zip(layout.q_batch[layout.history_rows], append_pos)],
        "append_offsets": (append_pos % ps).tolist(),
    }


def test_packed_fields_equal_a_row_by_row_reading_of_the_layout_for_random_batches():
    rng = np.random.default_rng(0)
    for trial in range(30):
        B, ps = int(rng.integers(1, 6)), int(rng.choice([1, 4, 16]))
        history = rng.integers(1, 60, B).tolist()
        cached = [int(rng.integers(0, h + 1)) for h in history]
        candidates = rng.integers(0, 4, B).tolist()
        perm = rng.permutation(1000).tolist()
        pages, at = [], 0
        for h in history:
            n = -(-h // ps)
            pages.append(perm[at : at + n])
            at += n
        layout = JaggedLayout.build(history, cached, candidates)
        meta = KVCacheMetadata.from_layout(pages, layout, ps)
        got = {k: v.tolist() for k, v in meta.tensors().items()}
        assert got == _expected_fields(history, cached, candidates, pages, ps), f"trial {trial}"
        assert meta.max_q == max(h - c + m for h, c, m in zip(history, cached, candidates))
        # int32 arrays (what the manager's reserve_arrays hands over) pack the same bytes
        arrays = KVCacheMetadata.from_layout([np.array(p, dtype=np.int32) for p in pages], layout, ps)
        assert {k: v.tolist() for k, v in arrays.tensors().items()} == got, f"trial {trial}"


def test_a_batch_that_does_not_fit_its_bucket_or_staging_is_rejected():
    from hstu.ops.kvcache.metadata import PadSpec

    layout = JaggedLayout.build([9, 5], [0, 0], [1, 1])
    pages = [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="q_batch has 16 entries; the bucket holds 8"):
        KVCacheMetadata.from_layout(pages, layout, 4, pad=PadSpec(rows=8, max_batch=2, max_pages=3, scratch_page=9))
    with pytest.raises(ValueError, match=r"page_table \(2, 3\) does not fit the bucket's \(2, 2\)"):
        KVCacheMetadata.from_layout(pages, layout, 4, pad=PadSpec(rows=32, max_batch=2, max_pages=2, scratch_page=9))
    small = torch.empty(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="staging buffer of 64 bytes cannot hold"):
        KVCacheMetadata.from_layout(pages, layout, 4, pad=PadSpec(32, 2, 3, 9, staging=small))
