"""KVCacheMetadata: everything the paged block needs to know about one batch's pages.

Built on the host by the prepare worker (one C++ pass, csrc/pack_metadata.cpp; pinned when CUDA)
and moved to the device in one go: pack_metadata writes every array into one host buffer
(PackedMetadata), so the move is one H2D copy (not 13 small ones, each a launch on the model
thread) and the views are built on the device only; a CUDA-graph batch copies the buffer into its
bucket's and needs no views. The block only reads it. Layout of rows follows ops/kvcache/layout.py's
JaggedLayout: per user, its new history tokens then its candidates.

Padded metadata (for a CUDA-graph bucket, `PadSpec`): every array is padded on the host to the
bucket's static shape, so the graph's static metadata is refreshed by one copy of the packed
buffer, whichever fields the captured attention backend reads. `_PADDING` names the fill of each
field past the batch's own entries (csrc/pack_metadata.cpp applies it; the tests check against it):
  "scratch"  the scratch page no user owns (padded appends write there, padded users read it)
  "last"     the batch's last offset: padded users and rows own nothing
  "row"      the row index: padded rows get q_batch 0 and q_local >= T, never a real row's slot
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from typing import Sequence

import torch

from hstu.ops._build import load_extension

_ext = load_extension()


@dataclass(frozen=True)
class PadSpec:
    """Static shapes of one CUDA-graph bucket: rows, users, pages per user, and the scratch page;
    `staging`, when set, is the host buffer (pinned on CUDA) the padded metadata is packed into,
    at its start (the bucket's own staging slot, engine/graphs.py); `slot` its index among the
    bucket's slots and `inputs` the slot's feature rows after the metadata (views made once, at
    capture: a batch makes no tensor views to find them)."""

    rows: int
    max_batch: int
    max_pages: int
    scratch_page: int
    staging: torch.Tensor | None = field(default=None, compare=False, repr=False)
    slot: int = field(default=-1, compare=False)
    inputs: torch.Tensor | None = field(default=None, compare=False, repr=False)


_PADDING: dict[str, int | str] = {
    "page_table": "scratch",
    "page_indices": "scratch",
    "page_indptr": "last",
    "last_page_len": 1,
    "kv_lens": 0,
    "cached_lens": 0,
    "q_offsets": "last",
    "q_batch": 0,
    "q_local": "row",
    "q_pos": -1,
    "append_rows": 0,
    "append_page_ids": "scratch",
    "append_offsets": 0,
}


# KVCacheMetadata fields that are not its per-row/per-user tensors
_HOST_FIELDS = ("max_q", "skip_page", "packed", "attention_plans")


@dataclass
class KVCacheMetadata:
    """Per-batch page and row indices. Tensors live on one device; ints are host values.

    page_table     [B, max_pages] int32   user b's pages (padded with its first page)
    page_indices   [sum_pages] int32      CSR page list, page_indptr [B+1] int32
    last_page_len  [B] int32              tokens in each user's last page, in [1, page_size]
    kv_lens        [B] int32              history tokens in the pages once this batch appended
    cached_lens    [B] int32              tokens reused from the cache
    q_offsets      [B+1] int32            jagged row offsets (new history + candidates)
    q_batch, q_local, q_pos [T] int64     user, row within user, absolute position (-1 candidate)
    append_rows    [Tn] int64             rows of new history tokens
    append_page_ids, append_offsets [Tn] int32  their page slots
    max_q          int                    longest user's row count (static for compile)
    skip_page      int                    the scratch page that padded appends name (a CUDA graph
                                          bucket's), not to be written; -1 when not padded
    """

    page_table: torch.Tensor
    page_indices: torch.Tensor
    page_indptr: torch.Tensor
    last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    cached_lens: torch.Tensor
    q_offsets: torch.Tensor
    q_batch: torch.Tensor
    q_local: torch.Tensor
    q_pos: torch.Tensor
    append_rows: torch.Tensor
    append_page_ids: torch.Tensor
    append_offsets: torch.Tensor
    max_q: int
    skip_page: int = -1
    # (one host buffer, [(field, byte offset, dtype, shape)]) when built by from_pages: `to` moves it whole.
    packed: tuple[torch.Tensor, list[tuple[str, int, torch.dtype, tuple[int, ...]]]] | None = field(
        default=None, repr=False, compare=False
    )
    # The attention kernel's schedule of this batch on the device, written by layer 0's call and
    # read by the others (ops/gluon_attention.py planned): every layer sees the same rows and
    # keys, so one plan launch a forward instead of one a layer. Keyed by the launch's shape.
    attention_plans: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_pages(cls, *args, **kwargs) -> "KVCacheMetadata":
        """pack_metadata(*args, **kwargs) (page lists, history and cached lengths, candidate counts,
        page size, pin, pad) as views over its buffer, where that buffer lives."""
        packed = pack_metadata(*args, **kwargs)
        return packed.to(packed.buffer.device)

    @classmethod
    def from_layout(
        cls, page_lists: Sequence[Sequence[int]], layout, page_size: int, pin: bool = False, pad: PadSpec | None = None
    ) -> "KVCacheMetadata":
        """from_pages for a JaggedLayout (its lengths)."""
        packed = pack_layout(page_lists, layout, page_size, pin, pad)
        return packed.to(packed.buffer.device)

    @classmethod
    def padded_empty(cls, pad: PadSpec, page_size: int) -> "KVCacheMetadata":
        """A bucket's metadata before any batch: no users, every field at its padding."""
        return cls.from_pages([], [], [], [], page_size, pad=pad)

    @property
    def layout_key(self) -> tuple | None:
        """Shapes and offsets of the packed buffer: equal keys mean one copy refreshes the other."""
        return None if self.packed is None else tuple(self.packed[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field by name (not max_q, skip_page or the packed buffer)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _HOST_FIELDS}

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "KVCacheMetadata":
        """This metadata on `device`: one copy of the packed buffer when there is one."""
        if self.packed is not None:
            buffer, layout = self.packed
            moved_buffer = buffer.to(device, non_blocking=non_blocking)
            return KVCacheMetadata(
                **_views(moved_buffer, layout), max_q=self.max_q, skip_page=self.skip_page, packed=(moved_buffer, layout)
            )
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()}
        return KVCacheMetadata(**moved, max_q=self.max_q, skip_page=self.skip_page)


@dataclass(frozen=True)
class PackedMetadata:
    """One batch's metadata as the prepare worker builds it: every field in one host buffer
    (pinned on CUDA). `to(device)` gives the KVCacheMetadata views (one copy); a CUDA-graph
    bucket copies `buffer` into its own static buffer and needs no views at all."""

    buffer: torch.Tensor
    layout: tuple[tuple[str, int, torch.dtype, tuple[int, ...]], ...]
    max_q: int
    skip_page: int = -1

    @property
    def packed(self) -> tuple[torch.Tensor, tuple]:
        return self.buffer, self.layout

    @property
    def layout_key(self) -> tuple:
        return self.layout

    def to(self, device: torch.device | str, non_blocking: bool = True) -> KVCacheMetadata:
        moved = self.buffer.to(device, non_blocking=non_blocking)
        return KVCacheMetadata(
            **_views(moved, self.layout), max_q=self.max_q, skip_page=self.skip_page, packed=(moved, self.layout)
        )


def pack_layout(page_lists, layout, page_size: int, pin: bool = False, pad: PadSpec | None = None) -> PackedMetadata:
    """pack_metadata for a JaggedLayout (its lengths)."""
    return pack_metadata(
        page_lists, layout.history_lens, layout.cached_lens, layout.num_candidates, page_size, pin, pad
    )


def pack_metadata(
    page_lists: Sequence[Sequence[int]],  # int32 arrays (reserve_arrays) or lists
    history_lens: list[int],
    cached_lens: list[int],
    num_candidates: list[int],
    page_size: int,
    pin: bool = False,
    pad: PadSpec | None = None,
) -> PackedMetadata:
    """Every field of the batch's metadata written straight into one host buffer (padded to
    `pad`'s static shapes when given), rows in JaggedLayout order. Here: the shapes and the byte
    offsets (a few integers per user); the fields are filled by one C++ pass
    (csrc/pack_metadata.cpp), with no per-row or per-page Python and no numpy call over the rows."""
    B = len(page_lists)
    if not len(history_lens) == len(cached_lens) == len(num_candidates) == B:
        raise ValueError(
            f"{B} page lists for {len(history_lens)} history lengths, {len(cached_lens)} cached lengths "
            f"and {len(num_candidates)} candidate counts"
        )
    counts = [len(p) for p in page_lists]  # each checked against its history in C++
    max_pages = max(counts, default=1)
    Tn = sum(history_lens) - sum(cached_lens)
    T = Tn + sum(num_candidates)
    if pad is not None:
        if B > pad.max_batch or max_pages > pad.max_pages:
            raise ValueError(f"page_table ({B}, {max_pages}) does not fit the bucket's ({pad.max_batch}, {pad.max_pages})")
        for name, n, size in (("q_batch", T, pad.rows), ("append_rows", Tn, pad.rows)):
            if n > size:
                raise ValueError(f"metadata field {name} has {n} entries; the bucket holds {size}")
        nB, nP, nT, nTn, max_q = pad.max_batch, pad.max_pages, pad.rows, pad.rows, pad.rows
        n_indices = nB * nP
    else:
        nB, nP, nT, nTn = B, max(max_pages, 1), T, Tn
        n_indices = sum(counts)
        max_q = max((h - c + m for h, c, m in zip(history_lens, cached_lens, num_candidates)), default=0)
    layout, offsets, total = _packed_layout(nB, nP, n_indices, nT, nTn)
    staging = pad.staging if pad is not None else None
    if staging is None:
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    elif staging.numel() < total:
        raise ValueError(f"staging buffer of {staging.numel()} bytes cannot hold {total} bytes of metadata")
    else:
        buffer = staging[:total]
    _ext.pack_metadata(
        buffer, offsets, page_lists, list(history_lens), list(cached_lens),
        list(num_candidates), page_size, nB, nP, nT, nTn, pad is not None, pad.scratch_page if pad is not None else 0,
    )
    return PackedMetadata(buffer, layout, max_q, pad.scratch_page if pad is not None else -1)


@functools.lru_cache(maxsize=256)
def _packed_layout(nB: int, nP: int, n_indices: int, nT: int, nTn: int) -> tuple[tuple, tuple[int, ...], int]:
    """(layout: (field, byte offset, dtype, shape) per field, the offsets alone, total bytes) of a
    packed buffer of these sizes. Cached: a graph bucket's padded sizes are the same every batch."""
    shapes = (
        ("page_table", torch.int32, (nB, nP)), ("page_indices", torch.int32, (n_indices,)),
        ("page_indptr", torch.int32, (nB + 1,)), ("last_page_len", torch.int32, (nB,)), ("kv_lens", torch.int32, (nB,)),
        ("cached_lens", torch.int32, (nB,)), ("q_offsets", torch.int32, (nB + 1,)), ("q_batch", torch.int64, (nT,)),
        ("q_local", torch.int64, (nT,)), ("q_pos", torch.int64, (nT,)), ("append_rows", torch.int64, (nTn,)),
        ("append_page_ids", torch.int32, (nTn,)), ("append_offsets", torch.int32, (nTn,)),
    )
    layout, total = [], 0
    for name, dtype, shape in shapes:
        layout.append((name, total, dtype, shape))
        total += -(-dtype.itemsize * math.prod(shape) // _ALIGN) * _ALIGN
    return tuple(layout), tuple(offset for _, offset, _, _ in layout), total  # tuples: shared by every caller


# Bytes: every packed array starts 16-byte aligned, as a separate allocation would. Triton
# specialises a kernel on whether each pointer is 16-byte aligned: 8-byte offsets made the eager
# attention recompile (3 s) for new batch layouts (H200 seed replay, 2026-12-02).
_ALIGN = 16


def _views(buffer: torch.Tensor, layout) -> dict[str, torch.Tensor]:
    """The typed, shaped tensors of `layout` as views into `buffer` (host or device)."""
    return {
        name: buffer[offset : offset + dtype.itemsize * math.prod(shape)].view(dtype).view(shape)
        for name, offset, dtype, shape in layout
    }
