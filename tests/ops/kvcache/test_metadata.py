"""KVCacheMetadata: from_pages packs every array into one host buffer that `to` moves whole."""

from __future__ import annotations

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
