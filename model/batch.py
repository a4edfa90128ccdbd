"""Ranking requests and the token view of a history.

A history of E events becomes num_contextual + 2E tokens: the contextual tokens, then for each
event an item token and an action token. Every token's embedding depends only on the history up to
that token (never on the request time or the candidates), so K/V computed once stay valid while the
history only grows. `identity(model_id)` gives the exact prefix digests (model/identity.py) that
decide whether cached K/V may be reused.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np

from hstu.model.config import HSTUConfig
from hstu.model.identity import HistoryIdentity, token_records
from hstu.ops._build import load_extension

TOKEN_CONTEXTUAL, TOKEN_ITEM, TOKEN_ACTION, TOKEN_CANDIDATE = 0, 1, 2, 3


@dataclass
class RankingRequest:
    """One user's ranking request: the full history (oldest first) and the items to score.

    The arrays are read-only copies: the request's identity digests are computed once and must
    keep describing exactly these values."""

    user_id: int
    item_ids: np.ndarray
    actions: np.ndarray
    timestamps: np.ndarray
    candidates: np.ndarray
    contextual: np.ndarray
    _identities: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _valid_for: HSTUConfig | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def create(
        cls,
        user_id: int,
        item_ids,
        actions,
        timestamps,
        candidates,
        contextual=None,
        config: HSTUConfig | None = None,
    ) -> "RankingRequest":
        """Build a request from sequences; contextual features default to ones derived from user_id."""
        cfg = config or HSTUConfig()
        if contextual is None:
            contextual = [(user_id * 7919 + i * 104729) % cfg.num_contextual_features for i in range(cfg.num_contextual)]
        req = cls(
            user_id=int(user_id),
            item_ids=_frozen(item_ids),
            actions=_frozen(actions),
            timestamps=_frozen(timestamps),
            candidates=_frozen(candidates),
            contextual=_frozen(contextual),
        )
        req.validate(cfg)
        return req

    def __reduce__(self):
        """Pickled (to an engine process, a Ray replica, from a parse worker) as one bytes object
        holding the five int64 arrays back to back, their lengths, and each identity's digests
        but not its token records. On arrival the arrays are read-only views over that bytes
        object (no copy, nothing to freeze: numpy unpickled each array through a copy, ~20 us a
        request), and the records are rebuilt from them (token_records, ~3 us for 4k tokens; sent,
        they doubled a request's bytes: 32 bytes an event against the arrays' 24)."""
        arrays = [getattr(self, name) for name in _ARRAYS]
        blob = b"".join(np.ascontiguousarray(a, dtype="<i8").tobytes() for a in arrays)
        digests = {model_id: ident.digests() for model_id, ident in self._identities.items()}
        return _restored_request, (self.user_id, blob, tuple(a.shape[0] for a in arrays), digests, self._valid_for)

    def first_events(self, events: int, config: HSTUConfig | None = None) -> "RankingRequest":
        """The same request (user, contextual features, candidates) with its history cut to its
        first `events` events: an earlier request of the same session."""
        return RankingRequest.create(
            self.user_id, self.item_ids[:events], self.actions[:events], self.timestamps[:events], self.candidates,
            self.contextual, config,
        )

    def for_user(self, user_id: int) -> "RankingRequest":
        """The same request (history, contextual features, candidates: the same read-only arrays)
        under another user id. It keeps its validation, since nothing validated depends on the id
        but its sign, and not its identity digests: a copy is hashed afresh when ranked, as a new
        request is. (dataclasses.replace dropped both: a benchmark's copies were validated again
        inside the timed call, which a request made by create() never is.)"""
        req = dataclasses.replace(self, user_id=int(user_id))
        if req.user_id >= 0:
            req._valid_for = self._valid_for
        return req

    @property
    def num_events(self) -> int:
        return int(self.item_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """History tokens: the contextual ones, then two per event (the identity's records)."""
        return int(self.contextual.shape[0]) + 2 * self.num_events

    def history_tokens(self, config: HSTUConfig) -> int:
        return config.history_tokens(self.num_events)

    def validate(self, config: HSTUConfig) -> None:
        """Raise ValueError naming the first offending value. A request passes once per config:
        its arrays are read-only, so the batch path does not check it again; nor does an engine
        process that receives it pickled from the front end that checked it (an equal config)."""
        if self._valid_for is config or self._valid_for == config:
            return
        if self.user_id < 0:
            raise ValueError(f"user_id must be >= 0, got {self.user_id}")
        n = self.num_events
        if self.actions.shape[0] != n or self.timestamps.shape[0] != n:
            raise ValueError(
                f"user {self.user_id}: item_ids, actions, timestamps need equal lengths, got "
                f"{n}, {self.actions.shape[0]}, {self.timestamps.shape[0]}"
            )
        if self.contextual.shape[0] != config.num_contextual:
            raise ValueError(
                f"user {self.user_id}: expected {config.num_contextual} contextual features, got {self.contextual.shape[0]}"
            )
        if self.candidates.shape[0] == 0:
            raise ValueError(f"user {self.user_id}: a request needs at least one candidate")
        tokens = self.history_tokens(config)
        if tokens + 1 > config.max_seq_len:
            raise ValueError(
                f"user {self.user_id}: history of {n} events is {tokens} tokens; max_seq_len is {config.max_seq_len}"
            )
        code, index, value = load_extension().check_request(
            self.item_ids, self.actions, self.timestamps, self.candidates, self.contextual,
            config.num_items, config.num_actions, config.num_contextual_features,
        )
        if code == 5:
            raise ValueError(f"user {self.user_id}: timestamps must be non-decreasing, event {index} goes back in time")
        if code == 6:
            raise ValueError(f"user {self.user_id}: timestamps must be >= 0, got {value}")
        if code:
            name, upper = _RANGE_FIELDS[code - 1]
            raise ValueError(f"user {self.user_id}: {name} value {value} out of range [0, {getattr(config, upper)})")
        self._valid_for = config

    def identity(self, model_id: bytes) -> HistoryIdentity:
        """Prefix digests of this history under the model `model_id` (built once, then reused)."""
        ident = self._identities.get(model_id)
        if ident is None:  # its records built when first read (HistoryIdentity.deferred)
            make = functools.partial(token_records, self.contextual, self.item_ids, self.actions, self.timestamps)
            ident = self._identities[model_id] = HistoryIdentity.deferred(model_id, self.num_tokens, make)
        return ident

    def adopt_identity(self, model_id: bytes, identity: HistoryIdentity) -> None:
        """Use `identity` (built over exactly this history, e.g. HistoryIdentity.extended from a
        stored prefix) as this request's identity under `model_id`, instead of hashing it again."""
        tokens = self.num_tokens
        if identity.num_tokens != tokens:
            raise ValueError(f"user {self.user_id}: identity covers {identity.num_tokens} tokens, the history has {tokens}")
        self._identities[model_id] = identity


_ARRAYS = ("item_ids", "actions", "timestamps", "candidates", "contextual")


def _restored_request(user_id: int, blob: bytes, lengths: tuple[int, ...], digests: dict, valid_for) -> RankingRequest:
    """A pickled RankingRequest (its __reduce__): read-only array views over `blob`, identities
    restored over records rebuilt from them."""
    flat = np.frombuffer(blob, dtype="<i8").astype(np.int64, copy=False)  # a view on little-endian hosts
    flat.setflags(write=False)  # (already so for a view of the bytes; a big-endian host's copy too)
    if flat.shape[0] != sum(lengths):
        raise ValueError(f"a pickled request of {flat.shape[0]} values for arrays of {lengths}")
    arrays, start = {}, 0
    for name, n in zip(_ARRAYS, lengths):
        arrays[name] = flat[start : start + n]
        start += n
    req = RankingRequest(user_id, **arrays)
    req._valid_for = valid_for
    if digests:
        records = token_records(req.contextual, req.item_ids, req.actions, req.timestamps)
        req._identities = {model_id: HistoryIdentity.restored(records, *d) for model_id, d in digests.items()}
    return req


def _frozen(values) -> np.ndarray:
    arr = np.array(values, dtype=np.int64).reshape(-1)
    arr.setflags(write=False)
    return arr


# check_request's fields 1-4 (csrc/request_checks.cpp): the array's name and the config bound.
_RANGE_FIELDS = (
    ("item_ids", "num_items"), ("candidates", "num_items"), ("actions", "num_actions"),
    ("contextual", "num_contextual_features"),
)

