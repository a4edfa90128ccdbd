"""Exact identity of cached K/V: digests that decide whether a cached prefix may be reused.

The K/V of history token t depend on every input of tokens 0..t and on the model. Cached K/V
are therefore reused only when a collision-resistant digest over all of those inputs matches;
an arithmetic mix of the fields (which can wrap, or be cancelled by a change in another field)
is never used.

Token records: each history token is one fixed-size record of two little-endian int64,
    contextual token c      [contextual[c], 0]
    item token of event e   [item_ids[e],   timestamps[e]]
    action token of event e [actions[e],    timestamps[e]]
The token type at each position follows from num_contextual, which the model identity covers,
so the byte string of a prefix determines its inputs exactly (fixed-size records: no two
different inputs share bytes). The time-gap feature of event e reads timestamps[e - 1], which is
in the prefix too.

Chain: D_0 = H_root(model identity); D_{b+1} = H_block(D_b || records of block b), blocks of
BLOCK_TOKENS tokens. The digest of a prefix of L tokens is D_{L / B} when L is a block boundary,
else H_tail(D_{L // B} || records of the partial block). H is SHA-256 over a fixed-length role tag
and the parts, so a tail digest never stands for a block digest (SHA-256 rather than blake2b:
CPUs with SHA extensions hash it ~2.5x faster, and a 4k-event history costs ~0.1 ms). Chaining
means a longer prefix extends a shorter one by hashing only the new blocks (`extended`: a stored
history plus a client's new events, serving/incremental.py).

The model identity is a digest of the config and of every weight (computed once per model and
again after a checkpoint load), so K/V never outlive the weights that produced them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import weakref
from typing import Callable

import numpy as np
import torch

from hstu.ops._build import load_extension

BLOCK_TOKENS = 512  # ~95 us for a 4k-event history here (128: ~165 us, Python per block)
DIGEST_BYTES = 32
_ROOT, _BLOCK, _TAIL, _MODEL = b"hstu.root\0", b"hstu.block", b"hstu.tail\0", b"hstu.model"


def _h(role: bytes, *parts) -> bytes:
    h = hashlib.sha256(role)
    for p in parts:
        h.update(p)
    return h.digest()


@functools.lru_cache(maxsize=16)
def _root(model_id: bytes) -> bytes:
    """D_0 of a model: one per model (and checkpoint), not one hash per request's identity."""
    return _h(_ROOT, model_id)


def token_records(contextual: np.ndarray, item_ids: np.ndarray, actions: np.ndarray, timestamps: np.ndarray) -> np.ndarray:
    """[num_contextual + 2E, 2] little-endian int64 records, one per history token (layout above;
    one C++ pass, csrc/request_checks.cpp)."""
    return load_extension().token_records(contextual, item_ids, actions, timestamps)


def _same_bytes(a: memoryview, b: memoryview, start: int, stop: int) -> bool:
    """Whether bytes [start, stop) of two records buffers are equal (one memcmp, no copies)."""
    return load_extension().same_bytes(a, b, start, stop)


_MAX_TAILS = 8  # tail digests kept per identity (a few lengths are asked for per batch)


class HistoryIdentity:
    """Prefix digests of one history under one model; block digests are computed once, lazily."""

    __slots__ = ("_data", "_make", "_chain", "num_tokens", "_tails", "_shared", "__weakref__")

    def __init__(self, model_id: bytes, records: np.ndarray) -> None:
        self._data: memoryview | None = memoryview(np.ascontiguousarray(records, dtype="<i8")).cast("B")
        self._make: Callable[[], np.ndarray] | None = None
        self.num_tokens = int(records.shape[0])
        self._chain = [_root(model_id)]
        # prefix(length) digests of lengths off a block boundary: a batch asks for the same
        # one or two (cached, whole history) several times (lookup, extension check, commit).
        self._tails: dict[int, bytes] = {}
        # (weak reference to the identity, length) of the last shares_prefix match: the lookup asks
        # about the same entry twice. Weak: a strong one would chain every identity a user's entry
        # was ever committed with to the next one, each holding its records, for as long as the
        # user is cached.
        self._shared: tuple[weakref.ref, int] | None = None

    @classmethod
    def deferred(cls, model_id: bytes, num_tokens: int, make_records: Callable[[], np.ndarray]) -> "HistoryIdentity":
        """The identity of the `num_tokens` records make_records() returns, built the first time they
        are read: a batch that extends a GPU entry reads them only after its launch (the prefix
        check and the commit's digest), so the plan before it does not build them (~4 us a 4k-token
        history, dev CPU). make_records must not hold the request (its arrays only: no cycle)."""
        out = object.__new__(cls)
        out._data, out._make, out.num_tokens = None, make_records, int(num_tokens)
        out._chain, out._tails, out._shared = [_root(model_id)], {}, None
        return out

    @property
    def _bytes(self) -> memoryview:
        """The records as bytes (built now if deferred; their count checked against num_tokens)."""
        data = self._data
        if data is None:
            records = np.ascontiguousarray(self._make(), dtype="<i8")
            if records.shape[0] != self.num_tokens:
                raise ValueError(f"deferred records cover {records.shape[0]} tokens, the identity {self.num_tokens}")
            data = self._data = memoryview(records).cast("B")
            self._make = None
        return data

    @property
    def records(self) -> np.ndarray:
        """The [num_tokens, 2] int64 token records this identity covers (a read-only view)."""
        view = np.frombuffer(self._bytes, dtype="<i8").reshape(-1, 2)
        view.setflags(write=False)
        return view

    def extended(self, length: int, records: np.ndarray) -> "HistoryIdentity":
        """The identity of this history's first `length` tokens followed by `records` ([N, 2]):
        the block digests already computed for that prefix are reused, only later blocks are hashed."""
        if not 0 <= length <= self.num_tokens:
            raise ValueError(f"prefix length {length} outside [0, {self.num_tokens}]")
        joined = np.concatenate([self.records[:length], np.asarray(records, dtype="<i8").reshape(-1, 2)])
        out = object.__new__(HistoryIdentity)
        out._data, out._make = memoryview(joined).cast("B"), None
        out.num_tokens = int(joined.shape[0])
        out._chain = self._chain[: length // BLOCK_TOKENS + 1]
        out._tails = {}
        out._shared = None
        return out

    def shares_prefix(self, other: "HistoryIdentity", length: int) -> bool:
        """Whether this history's first `length` tokens under this model are exactly `other`'s:
        the same model (root digest) and the records compared byte for byte (~4 us for 4k tokens,
        where hashing them takes ~40 us). When both identities already hold the block digest that
        covers the prefix's whole blocks (a front end hashed the request, the stored one was hashed
        when committed), equal digests stand for those blocks, as they do for any cached prefix,
        and only the records past them are compared (at most BLOCK_TOKENS). When they are equal,
        this identity takes over the digests `other` has computed for that prefix, which are its own."""
        shared = self._shared
        if shared is not None and shared[0]() is other and length <= shared[1]:
            return True
        if not 0 <= length <= min(self.num_tokens, other.num_tokens) or self._chain[0] != other._chain[0]:
            return False
        b = length // BLOCK_TOKENS
        start = 0
        if b and len(self._chain) > b and len(other._chain) > b:
            if self._chain[b] != other._chain[b]:
                return False
            start = b * BLOCK_TOKENS * 16
        # One memcmp in place (csrc/request_checks.cpp): the bytes() copies it replaced cost ~8.6 us
        # for 4k tokens inside a batch's lookup, where a front end had not hashed the request.
        if not _same_bytes(self._bytes, other._bytes, start, length * 16):
            return False
        self._shared = (weakref.ref(other), length)
        blocks = min(length // BLOCK_TOKENS + 1, len(other._chain))
        if blocks > len(self._chain):
            self._chain = other._chain[:blocks]
        tail = other._tails.get(length)
        if length % BLOCK_TOKENS and tail is not None and length not in self._tails:
            if len(self._tails) >= _MAX_TAILS:
                self._tails.clear()
            self._tails[length] = tail
        return True

    def __reduce__(self):
        """Pickled with its records and the block and tail digests computed so far (a parse worker
        or front-end process hashes a history once, the whole history's digest included; the
        engine process reuses them instead of hashing the tail again on its prepare worker). A
        RankingRequest pickles only digests() and rebuilds the records from its arrays."""
        return _restored_identity, (bytes(self._bytes), *self.digests())

    def digests(self) -> tuple[list[bytes], int, dict[int, bytes]]:
        """(block digests, tokens covered, tail digests) computed so far: with the same records,
        restored() rebuilds this identity without hashing again."""
        return list(self._chain), self.num_tokens, dict(self._tails)

    @classmethod
    def restored(
        cls, records: np.ndarray, chain: list[bytes], num_tokens: int, tails: dict[int, bytes] | None = None
    ) -> "HistoryIdentity":
        """The identity whose digests() were (chain, num_tokens, tails), over `records` ([N, 2]
        int64, exactly the records those digests were computed from: the caller's guarantee)."""
        if records.shape[0] != num_tokens:
            raise ValueError(f"records cover {records.shape[0]} tokens, the digests {num_tokens}")
        return _restored_identity(memoryview(np.ascontiguousarray(records, dtype="<i8")).cast("B"), chain, num_tokens, tails)

    def _block(self, b: int) -> bytes:
        step = BLOCK_TOKENS * 16
        while len(self._chain) <= b:
            i = len(self._chain) - 1
            self._chain.append(_h(_BLOCK, self._chain[i], self._bytes[i * step : (i + 1) * step]))
        return self._chain[b]

    def prefix(self, length: int) -> bytes:
        """Digest of the first `length` tokens (0 <= length <= num_tokens)."""
        if not 0 <= length <= self.num_tokens:
            raise ValueError(f"prefix length {length} outside [0, {self.num_tokens}]")
        b, rest = divmod(length, BLOCK_TOKENS)
        head = self._block(b)
        if rest == 0:
            return head
        digest = self._tails.get(length)
        if digest is None:
            start = b * BLOCK_TOKENS * 16
            digest = _h(_TAIL, head, self._bytes[start : start + rest * 16])
            if len(self._tails) >= _MAX_TAILS:
                self._tails.clear()
            self._tails[length] = digest
        return digest


def _restored_identity(
    data: bytes | memoryview, chain: list[bytes], num_tokens: int, tails: dict[int, bytes] | None = None
) -> HistoryIdentity:
    out = object.__new__(HistoryIdentity)
    out._data = data if isinstance(data, memoryview) else memoryview(data).cast("B")
    out._make = None
    out._chain = chain
    out.num_tokens = num_tokens
    out._tails = tails or {}
    out._shared = None
    return out


def model_identity(model: torch.nn.Module, config) -> bytes:
    """Digest of a model's config and every parameter and buffer (name, dtype, shape, bytes)."""
    h = hashlib.sha256(_MODEL)
    h.update(json.dumps(config.to_dict(), sort_keys=True).encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.digest()
