"""KVCacheMetadata: everything the paged block needs to know about one batch's pages.

Built on the host by the prepare worker (numpy, pinned when CUDA) and moved to the device in one
go: from_pages packs every array into one host buffer, so the move is one H2D copy (not 13 small
ones, each a launch on the model thread) and the views are rebuilt on the device. The block only
reads it. Layout of rows follows model.preprocessor.JaggedLayout: per user, its
new history tokens then its candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import torch


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
    ) -> "KVCacheMetadata":
        """Host-side metadata from each user's page list (covering history_lens tokens)."""
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
        buffer, layout = _pack(arrays, pin)
        q_counts = np.diff(q_offsets)
        return cls(**_views(buffer, layout), max_q=int(q_counts.max()) if q_counts.size else 0, packed=(buffer, layout))

    @classmethod
    def from_layout(cls, page_lists: list[list[int]], layout, page_size: int, pin: bool = False) -> "KVCacheMetadata":
        """from_pages for a model.preprocessor.JaggedLayout (its lengths and row arrays)."""
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
        )

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
