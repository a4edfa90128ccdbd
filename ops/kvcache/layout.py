"""JaggedLayout: the row layout of one batch, the contract between the cache and the model.

Per user, in batch order: its new history tokens (positions cached_len .. history_len - 1), then
its candidates. The cache manager builds the layout when it plans a batch (it knows the cached
lengths); the model embeds exactly these rows and reads its logits from `candidate_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class JaggedLayout:
    """Row layout of one batch. q_pos = absolute position of history rows, -1 for candidates."""

    history_lens: list[int]
    cached_lens: list[int]
    num_candidates: list[int]
    q_offsets: np.ndarray
    q_batch: np.ndarray
    q_local: np.ndarray
    q_pos: np.ndarray
    history_rows: np.ndarray
    candidate_rows: np.ndarray

    @property
    def batch_size(self) -> int:
        return len(self.history_lens)

    @property
    def num_rows(self) -> int:
        return int(self.q_offsets[-1])

    @property
    def max_q(self) -> int:
        return int(np.diff(self.q_offsets).max()) if self.batch_size else 0

    @classmethod
    def build(cls, history_lens: list[int], cached_lens: list[int], num_candidates: list[int]) -> "JaggedLayout":
        new = np.asarray(history_lens, dtype=np.int64) - np.asarray(cached_lens, dtype=np.int64)
        cand = np.asarray(num_candidates, dtype=np.int64)
        rows = new + cand
        offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        q_batch = np.repeat(np.arange(len(rows)), rows)
        q_local = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], rows)
        is_hist = q_local < np.repeat(new, rows)
        q_pos = np.where(is_hist, q_local + np.repeat(np.asarray(cached_lens, dtype=np.int64), rows), -1)
        return cls(
            history_lens=list(history_lens),
            cached_lens=list(cached_lens),
            num_candidates=list(num_candidates),
            q_offsets=offsets,
            q_batch=q_batch,
            q_local=q_local,
            q_pos=q_pos,
            history_rows=np.flatnonzero(is_hist),
            candidate_rows=np.flatnonzero(~is_hist),
        )
