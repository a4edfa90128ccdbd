"""KVCacheMetadata: everything the paged block needs to know about one batch's pages.

Built on the host by the prepare worker (numpy, pinned when CUDA) and moved to the device in one
go; the block only reads it. Layout of rows follows model.preprocessor.JaggedLayout: per user, its
new history tokens then its candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in arrays.items()}
        if pin:
            tensors = {k: v.pin_memory() for k, v in tensors.items()}
        q_counts = np.diff(q_offsets)
        return cls(**tensors, max_q=int(q_counts.max()) if q_counts.size else 0)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "KVCacheMetadata":
        moved = {
            f.name: (getattr(self, f.name).to(device, non_blocking=non_blocking) if f.name != "max_q" else self.max_q)
            for f in fields(self)
        }
        return KVCacheMetadata(**moved)
