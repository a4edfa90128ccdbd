"""JaggedLayout: the row layout of one batch, the contract between the cache and the model.

Per user, in batch order: its new history tokens (positions cached_len .. history_len - 1), then
its candidates. The cache manager builds the layout when it plans a batch (it knows the cached
lengths); the model embeds exactly these rows and reads its logits from `candidate_rows`.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np


@dataclass
class JaggedLayout:
    """Row layout of one batch: per-user lengths and the row offsets. The per-row arrays (q_pos =
    absolute position of history rows, -1 for candidates) are built on first use only: the cached
    pipeline reads none of them (csrc/batch_features.cpp and csrc/pack_metadata.cpp derive the rows
    from the lengths), the eager paths and the tests do."""

    history_lens: list[int]
    cached_lens: list[int]
    num_candidates: list[int]
    q_offsets: np.ndarray

    @property
    def batch_size(self) -> int:
        return len(self.history_lens)

    @property
    def num_rows(self) -> int:
        return int(self.q_offsets[-1])

    @property
    def num_candidate_rows(self) -> int:
        return sum(self.num_candidates)

    @property
    def max_q(self) -> int:
        return int(np.diff(self.q_offsets).max()) if self.batch_size else 0

    @classmethod
    def build(cls, history_lens: list[int], cached_lens: list[int], num_candidates: list[int]) -> "JaggedLayout":
        rows = [h - c + m for h, c, m in zip(history_lens, cached_lens, num_candidates)]
        offsets = np.fromiter(itertools.accumulate(rows, initial=0), dtype=np.int64, count=len(rows) + 1)
        return cls(list(history_lens), list(cached_lens), list(num_candidates), offsets)

    @functools.cached_property
    def _rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        new = np.asarray(self.history_lens, dtype=np.int64) - np.asarray(self.cached_lens, dtype=np.int64)
        rows = np.diff(self.q_offsets)
        q_batch = np.repeat(np.arange(len(rows)), rows)
        q_local = np.arange(self.num_rows) - np.repeat(self.q_offsets[:-1], rows)
        is_hist = q_local < np.repeat(new, rows)
        q_pos = np.where(is_hist, q_local + np.repeat(np.asarray(self.cached_lens, dtype=np.int64), rows), -1)
        return q_batch, q_local, q_pos, is_hist

    @property
    def q_batch(self) -> np.ndarray:
        return self._rows[0]

    @property
    def q_local(self) -> np.ndarray:
        return self._rows[1]

    @property
    def q_pos(self) -> np.ndarray:
        return self._rows[2]

    @property
    def history_rows(self) -> np.ndarray:
        return np.flatnonzero(self._rows[3])

    @property
    def candidate_rows(self) -> np.ndarray:
        return np.flatnonzero(~self._rows[3])
