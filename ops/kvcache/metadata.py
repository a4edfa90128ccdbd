"""KVCacheMetadata: everything the paged block needs to know about one batch's pages.

Built on the host by the prepare worker (numpy, pinned when CUDA) and moved to the device in one
go: from_pages packs every array into one host buffer, so the move is one H2D copy (not 13 small
ones, each a launch on the model thread) and the views are rebuilt on the device. The block only
reads it. Layout of rows follows ops/kvcache/layout.py's JaggedLayout: per user, its
new history tokens then its candidates.

Padded metadata (for a CUDA-graph bucket, `PadSpec`): every array is padded on the host to the
bucket's static shape, so the graph's static metadata is refreshed by one copy of the packed
buffer, whichever fields the captured attention backend reads. `_PADDING` names the fill of each
field past the batch's own entries (a field without a rule is an error):
  "scratch"  the scratch page no user owns (padded appends write there, padded users read it)
  "last"     the batch's last offset: padded users and rows own nothing
  "row"      the row index: padded rows get q_batch 0 and q_local >= T, never a real row's slot
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch


@dataclass(frozen=True)
class PadSpec:
    """Static shapes of one CUDA-graph bucket: rows, users, pages per user, and the scratch page."""

    rows: int
    max_batch: int
    max_pages: int
    scratch_page: int


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
    # (one host buffer, [(field, byte offset, dtype, shape)]) when built by from_pages: `to` moves it whole.
    packed: tuple[torch.Tensor, list[tuple[str, int, torch.dtype, tuple[int, ...]]]] | None = field(
        default=None, repr=False, compare=False
    )

    @classmethod
    def from_pages(
        cls,
        page_lists: list[list[int]],
        history_lens: list[int],
        cached_lens: list[int],
        q_offsets: np.ndarray,
        q_batch: np.ndarray,
        q_local: np.ndarray,
        q_pos: np.ndarray,
        append_rows: np.ndarray,
        page_size: int,
        pin: bool = False,
        pad: PadSpec | None = None,
    ) -> "KVCacheMetadata":
        """Host-side metadata from each user's page list (covering history_lens tokens), padded
        to `pad`'s static shapes when given."""
        B = len(page_lists)
        for b in range(B):
            need = -(-history_lens[b] // page_size)
            if len(page_lists[b]) != need:
                raise ValueError(f"user {b}: {len(page_lists[b])} pages cannot hold exactly {history_lens[b]} tokens")
        max_pages = max((len(p) for p in page_lists), default=1) or 1
        table = np.zeros((B, max_pages), dtype=np.int32)
        for b, pages in enumerate(page_lists):
            table[b, : len(pages)] = pages
            table[b, len(pages) :] = pages[0] if pages else 0
        counts = np.asarray([len(p) for p in page_lists], dtype=np.int64)
        hist = np.asarray(history_lens, dtype=np.int64)
        # Absolute position of each appended token -> its page slot.
        append_pos = q_pos[append_rows]
        append_user = q_batch[append_rows]
        append_pages = table[append_user, append_pos // page_size] if append_rows.size else np.zeros(0, np.int32)
        arrays = dict(
            page_table=table,
            page_indices=np.concatenate([np.asarray(p, dtype=np.int32) for p in page_lists]) if B else np.zeros(0, np.int32),
            page_indptr=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            last_page_len=(hist - (counts - 1) * page_size).astype(np.int32),
            kv_lens=hist.astype(np.int32),
            cached_lens=np.asarray(cached_lens, dtype=np.int32),
            q_offsets=q_offsets.astype(np.int32),
            q_batch=q_batch.astype(np.int64),
            q_local=q_local.astype(np.int64),
            q_pos=q_pos.astype(np.int64),
            append_rows=append_rows.astype(np.int64),
            append_page_ids=np.asarray(append_pages, dtype=np.int32),
            append_offsets=(append_pos % page_size).astype(np.int32),
        )
        q_counts = np.diff(q_offsets)
        max_q = int(q_counts.max()) if q_counts.size else 0
        if pad is not None:
            arrays, max_q = _padded(arrays, pad), pad.rows
        buffer, layout = _pack(arrays, pin)
        return cls(**_views(buffer, layout), max_q=max_q, packed=(buffer, layout))

    @classmethod
    def from_layout(
        cls, page_lists: list[list[int]], layout, page_size: int, pin: bool = False, pad: PadSpec | None = None
    ) -> "KVCacheMetadata":
        """from_pages for a JaggedLayout (its lengths and row arrays)."""
        return cls.from_pages(
            page_lists,
            layout.history_lens,
            layout.cached_lens,
            layout.q_offsets,
            layout.q_batch,
            layout.q_local,
            layout.q_pos,
            layout.history_rows,
            page_size,
            pin=pin,
            pad=pad,
        )

    @classmethod
    def padded_empty(cls, pad: PadSpec, page_size: int) -> "KVCacheMetadata":
        """A bucket's metadata before any batch: no users, every field at its padding."""
        empty = np.zeros(0, dtype=np.int64)
        return cls.from_pages([], [], [], np.zeros(1, np.int64), empty, empty, empty, empty, page_size, pad=pad)

    @property
    def layout_key(self) -> tuple | None:
        """Shapes and offsets of the packed buffer: equal keys mean one copy refreshes the other."""
        return None if self.packed is None else tuple(self.packed[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field by name (not max_q, not the packed buffer)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("max_q", "packed")}

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "KVCacheMetadata":
        """This metadata on `device`: one copy of the packed buffer when there is one."""
        if self.packed is not None:
            buffer, layout = self.packed
            moved_buffer = buffer.to(device, non_blocking=non_blocking)
            return KVCacheMetadata(**_views(moved_buffer, layout), max_q=self.max_q, packed=(moved_buffer, layout))
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()}
        return KVCacheMetadata(**moved, max_q=self.max_q)


def _padded(arrays: dict[str, np.ndarray], pad: PadSpec) -> dict[str, np.ndarray]:
    """Every array at the bucket's static shape, filled past the batch's entries by `_PADDING`."""
    missing = set(arrays) - set(_PADDING)
    if missing:
        raise RuntimeError(f"no CUDA-graph padding rule for metadata fields {sorted(missing)}")
    B, P, T = pad.max_batch, pad.max_pages, pad.rows
    sizes = {"page_indices": B * P, "page_indptr": B + 1, "q_offsets": B + 1}
    sizes.update(dict.fromkeys(("last_page_len", "kv_lens", "cached_lens"), B))
    sizes.update(dict.fromkeys(("q_batch", "q_local", "q_pos", "append_rows", "append_page_ids", "append_offsets"), T))
    out = {}
    for name, a in arrays.items():
        fill = _PADDING[name]
        if name == "page_table":
            if a.shape[0] > B or a.shape[1] > P:
                raise ValueError(f"page_table {a.shape} does not fit the bucket's ({B}, {P})")
            table = np.full((B, P), pad.scratch_page, dtype=a.dtype)
            table[: a.shape[0], : a.shape[1]] = a
            out[name] = table
            continue
        n, size = a.shape[0], sizes[name]
        if n > size:
            raise ValueError(f"metadata field {name} has {n} entries; the bucket holds {size}")
        if fill == "scratch":
            padded = np.full(size, pad.scratch_page, dtype=a.dtype)
        elif fill == "last":
            padded = np.full(size, a[-1] if n else 0, dtype=a.dtype)
        elif fill == "row":
            padded = np.arange(size, dtype=a.dtype)
        else:
            padded = np.full(size, fill, dtype=a.dtype)
        padded[:n] = a
        out[name] = padded
    return out


# Bytes: every packed array starts 16-byte aligned, as a separate allocation would. Triton
# specialises a kernel on whether each pointer is 16-byte aligned: 8-byte offsets made the eager
# attention recompile (3 s) for new batch layouts (H200 seed replay, 2026-12-02).
_ALIGN = 16


def _pack(arrays: dict[str, np.ndarray], pin: bool) -> tuple[torch.Tensor, list]:
    """Copy the arrays into one uint8 host buffer (pinned if asked); return it and the layout."""
    layout, total = [], 0
    for name, a in arrays.items():
        layout.append((name, total, torch.from_numpy(a[:0]).dtype, tuple(a.shape)))
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
    host = buffer.numpy()
    for (name, offset, _, _), a in zip(layout, arrays.values()):
        host[offset : offset + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return buffer, layout


def _views(buffer: torch.Tensor, layout: list) -> dict[str, torch.Tensor]:
    """The typed, shaped tensors of `layout` as views into `buffer` (host or device)."""
    out = {}
    for name, offset, dtype, shape in layout:
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        out[name] = buffer.narrow(0, offset, nbytes).view(dtype).view(shape)
    return out
