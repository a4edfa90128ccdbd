"""Compute or load: how much of each host-tier prefix a batch onloads, and how much it recomputes.

A user whose history prefix of n tokens sits in the host tier (not on the GPU) can have it back
two ways: onload its K/V over the host link, or recompute it with the batch. Both from one prefix
at once (anchor: Cake, "Compute Or Load KV Cache? Why Not Both?", 2024): onload tokens [0, p)
and recompute [p, n) together with the new tokens, p on a chunk boundary. p = n is pure onload,
p = 0 pure recompute. GPU-resident prefixes are always used (they cost nothing); this only splits
host-tier prefixes.

Timeline of one batch (layer-wise, L layers): the onload stream copies layer 0's pages of every
onloading user, then layer 1's, ...; layer i's compute starts when layer i - 1's compute finished
and layer i's pages landed:
    load_layer    = onload_tokens * bytes_per_token_layer / h2d_bytes_per_s
                    (a token of a hidden-state chunk: hidden_bytes_per_token_layer)
    compute_layer = fixed_s + rows * per_row_s + pairs * per_pair_s
    finish_i      = max(finish_{i-1}, onload_start_s + (i + 1) * load_layer) + compute_layer
    batch         = forward_s + finish_{L-1}
where rows are the batch's computed rows (recomputed prefix tokens, new tokens, candidates) and
pairs the (query, key) pairs their attention reads; forward_s is what every forward costs whatever
it computes (host work, embedding, head), onload_start_s how much later than the layers an onload
gets going (a host-tier batch's own host work: pins, slot lists, the copy worker). The planner
picks one split fraction f for the batch (each user's p = f * n rounded down to a chunk)
minimising the batch's time: O(users x chunks). All costs are measured through the engine's own
forward at start-up (engine/calibration.py): modelled from kernels alone, forward_s was folded into
the per-layer cost, which hid an onload behind compute that was not there (the H200's batch 1
onloaded a 4k-token prefix in 3.9-4.2 ms where recomputing it took 3.3 ms).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np

from hstu.ops._build import load_extension

_ext = load_extension()


@dataclass(frozen=True)
class CostModel:
    """Inputs of the timeline above (seconds; fixed_s, per_row_s and per_pair_s per layer); measured
    at start-up (ops/kvcache/costs.py, engine/calibration.py) or given. min_gain: the predicted share
    of the batch's time an onload must save over recomputing every host-tier prefix to be chosen
    (and a split over onloading every prefix whole: plan()),
    the model's error kept off the wrong side of "never slower than no cache": on the H200 it
    predicted a batch-1 half split 7.6% faster than recomputing, which measured 5-6% slower (runs
    BA, BB), and a batch-8 split 12.8% faster, which measured 4-7% faster. front_s: what a batch
    with a front pass (host_split "compute_front") costs beyond the model of its layers, measured
    (engine/calibration.py measure_front)."""

    h2d_bytes_per_s: float
    bytes_per_token_layer: int
    per_row_s: float
    per_pair_s: float
    fixed_s: float = 0.0
    forward_s: float = 0.0
    onload_start_s: float = 0.0
    min_gain: float = 0.1
    front_s: float = 0.0
    # host_format "hidden": the bytes a token of a hidden-state chunk moves per layer (its layer
    # input); 0: every chunk costs bytes_per_token_layer (K/V)
    hidden_bytes_per_token_layer: int = 0
    # Among near-tied splits (margin_window, below), the one chosen is the fastest with its layers'
    # compute priced this share higher; the bars against pure onload and recomputing use the model as
    # it is. Why: where the model missed, batches ran slower than predicted (plan feedback factors
    # 1.06-2.4, runs MT-MW), and a split whose compute keeps pace with its copies takes all of such an
    # error, where one with slack takes none.
    # On H100s (runs MT-MU) it priced batch 1 onloading 17 and 18 of 31 chunks 0.01 ms apart: 17's
    # 2,176 recomputed rows run in the 3,072-row bucket, as long as its copies; 18's 2,048 rows have
    # slack. 17 measured 2.61-2.91 ms (0.96-1.02x of no cache), 18 2.33-2.59 ms (1.08-1.18x).
    compute_margin: float = 0.1
    # The margin ranks only the splits the model itself prices within this share of its best split
    # (near-ties); a split the model prices clearly faster is taken as it is. Why: ranking every
    # split with the margin let it overrule the model where the model saw a clear gap. On an H100
    # (session 51) two calibrations priced batch 8 onloading 16 of 31 chunks 0.46-0.58 ms (4-5%)
    # slower than 15 (15's front fills the 16,384-row bucket, 16's pads to it with more copies), and
    # the margin took 16 all the same: 11.95-11.98 ms (1.28-1.29x of no cache) against 15's
    # 10.56-10.90 ms (1.40-1.44x) in the same call. Batch 1's 17 and 18 chunks are 0.4% apart.
    margin_window: float = 0.02

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if not 0.0 <= self.compute_margin <= 1.0:
            raise ValueError(f"compute_margin must be in [0, 1], got {self.compute_margin}")
        if not 0.0 <= self.margin_window <= 1.0:
            raise ValueError(f"margin_window must be in [0, 1], got {self.margin_window}")
        for name in ("h2d_bytes_per_s", "bytes_per_token_layer"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("per_row_s", "per_pair_s", "fixed_s", "forward_s", "onload_start_s", "front_s",
                     "hidden_bytes_per_token_layer"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    def scaled(self, predicted_s: float, factor: float) -> float:
        """A batch's predicted seconds with its layers' part (all but forward_s) scaled by `factor`,
        what such plans measured against their predictions (plan_feedback.py)."""
        return self.forward_s + (predicted_s - self.forward_s) * factor

    def choose(
        self, users: list["UserShape"], num_layers: int, chunk_tokens: int, buckets: tuple[int, ...] | None = None,
        front: bool = False,
    ) -> "Plan":
        """The split minimising the predicted finish (plan below)."""
        return plan(users, self, num_layers, chunk_tokens, buckets, front)


@dataclass(frozen=True)
class FixedSplit:
    """Onload the same fraction of every host-tier prefix (whole chunks, rounded down), whatever
    it costs: for measuring the real time of each split against the cost model's prediction
    (`hstu bench --sections split`), and for pinning a split that measured best on a device."""

    fraction: float
    # under host_split "auto": which order the split takes (None: load_front; choose_split)
    order: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {self.fraction}")
        if self.order not in (None, "load_front", "compute_front"):
            raise ValueError(f"order must be None, 'load_front' or 'compute_front', got {self.order!r}")

    def choose(
        self, users: list["UserShape"], num_layers: int, chunk_tokens: int, buckets: tuple[int, ...] | None = None,
        front: bool = False,
    ) -> "Plan":
        if self.fraction == 1.0:
            return Plan([u.host_tokens for u in users], float("nan"), float("nan"), float("nan"))
        onload = [int(u.host_tokens // chunk_tokens * self.fraction) * chunk_tokens for u in users]
        return Plan(onload, float("nan"), float("nan"), float("nan"))


@dataclass(frozen=True)
class UserShape:
    """One user of the batch: its host-tier prefix (0 if none), history and candidate counts."""

    host_tokens: int
    gpu_tokens: int
    history_tokens: int
    candidates: int
    # which of the host prefix's chunks hold hidden states (host_format "hidden"), in order; the
    # rest, and all when empty, hold K/V
    hidden_chunks: tuple[bool, ...] = ()


@dataclass(frozen=True)
class Plan:
    """Onloaded prefix per user and the predicted times of the chosen split (seconds)."""

    onload_tokens: list[int]
    predicted_s: float
    onload_s: float
    compute_s: float


def choose_split(
    cost: "CostModel | FixedSplit", users: list[UserShape], num_layers: int, chunk_tokens: int,
    buckets: tuple[int, ...] | None, host_split: str, factor: "Callable[[Plan, bool], float] | None" = None,
) -> tuple[Plan, bool]:
    """(plan, front): the cost model's split of the batch under KVCacheConfig.host_split, and
    whether it recomputes the prefixes' fronts (compute_front). "auto" prices both orders and
    takes the faster (load_front on a tie; a FixedSplit, which predicts nothing, takes its own
    order, load_front by default): at batch 1 load_front's splits measured faster, at batch 8
    compute_front's, whose front pass runs beside the copies instead of after them (H100, runs
    BC, GB, GF). factor(plan, front): what such a plan measured against its prediction so far
    (plan_feedback.py), which scales each order's layers before they are compared: on an H100 (run
    GI) a batch-1 front split measured 2x its prediction (load_front's measured ~1.1x in other
    runs), and without it the next batches recomputed instead of taking load_front's split."""
    if host_split != "auto" or not isinstance(cost, CostModel):
        order = cost.order if host_split == "auto" and isinstance(cost, FixedSplit) else host_split
        front = order == "compute_front"
        return cost.choose(users, num_layers, chunk_tokens, buckets, front), front
    best: tuple[float, Plan, bool] | None = None
    for front in (False, True):  # load_front first: it keeps a tie
        chosen = cost.choose(users, num_layers, chunk_tokens, buckets, front)
        scale = factor(chosen, front) if factor is not None else 1.0
        priced_s = cost.scaled(chosen.predicted_s, scale)
        if best is None or priced_s < best[0]:
            best = (priced_s, chosen, front)
    return best[1], best[2]


def layer_work(users: list[UserShape], onload: list[int]) -> tuple[int, int]:
    """(rows, attention pairs) one layer computes when user u reuses `onload[u]` host tokens."""
    rows, pairs = _work(users, np.asarray([onload], dtype=np.int64))
    return int(rows[0]), int(pairs[0])


def padded_rows(rows: int, buckets: tuple[int, ...] | None) -> int:
    """Rows a batch of `rows` rows computes: its CUDA-graph bucket's (the smallest that holds it), or
    its own when no bucket does (eager) or graphs are off (buckets None)."""
    return int(_padded(np.asarray([rows], dtype=np.int64), buckets)[0])


def front_tokens(host_tokens: int, onload: int, chunk_tokens: int) -> int:
    """host_split "compute_front": the tokens a user recomputes from the front (whole chunks) when
    the last `onload` (or more) of its `host_tokens` host-tier tokens are onloaded."""
    # plain ints (_front's numpy on scalars was 4 us a call, a call per host-tier user before the copies start)
    return max(0, int(host_tokens) - int(onload)) // chunk_tokens * chunk_tokens


def predict(
    users: list[UserShape], onload: list[int], cost: CostModel, num_layers: int, buckets: tuple[int, ...] | None = None,
    chunk_tokens: int | None = None,
) -> tuple[float, float, float]:
    """(the batch's predicted time, total onload time, total compute time) for this split; the
    per-row cost applies to the rows of the batch's graph bucket (padding computes too: at batch 1
    a half split of a 4k-token prefix has 2,304 rows, which a 4,096-row bucket runs). chunk_tokens:
    needed when users name hidden-state chunks."""
    return _one(_predict_splits(users, np.asarray([onload], dtype=np.int64), cost, num_layers, buckets, chunk_tokens))


def predict_front(
    users: list[UserShape], onload: list[int], cost: CostModel, num_layers: int, chunk_tokens: int,
    buckets: tuple[int, ...] | None = None,
) -> tuple[float, float, float]:
    """predict() for host_split "compute_front": each host-tier user recomputes its first q tokens
    (front_tokens) in a pass of their own, which reads no onloaded page, while the rest of its
    prefix is onloaded; then the batch's pass computes every user's new tokens and candidates
    (a host-tier user the split onloads nothing of: its whole history), layer i after layer i's copies landed:
        front   = front_s + L x (fixed_s + rows_f x per_row_s + pairs_f x per_pair_s)   (causal within q)
        finish_i = max(finish_{i-1}, onload_start_s + (i + 1) * load_layer) + batch_layer,
        finish_-1 = front.
    A prefix onloaded whole or not at all has no front: at either end this is predict()."""
    onload_array = np.asarray([onload], dtype=np.int64)
    return _one(_predict_splits(users, onload_array, cost, num_layers, buckets, chunk_tokens, front=True))


def _one(predicted: tuple[np.ndarray, ...]) -> tuple[float, float, float]:
    finish, load, compute, _ = predicted
    return float(finish[0]), float(load[0]), float(compute[0])


def _front(host, onload, chunk_tokens: int):
    """front_tokens over arrays (front_tokens itself takes plain ints)."""
    return np.maximum(0, host - onload) // chunk_tokens * chunk_tokens


def _padded(rows: np.ndarray, buckets: tuple[int, ...] | None) -> np.ndarray:
    """padded_rows over an array."""
    if not buckets:
        return rows
    edges = np.asarray(buckets, dtype=np.int64)
    at = np.searchsorted(edges, rows)  # the smallest bucket >= rows
    return np.where(at < len(edges), edges[np.minimum(at, len(edges) - 1)], rows)


def _work(users: list[UserShape], start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows and attention pairs [K] one layer computes in each of K candidate splits, user u's first
    computed history position being max(gpu_tokens, start[k, u]): causal history rows, then
    candidates, which see the whole history."""
    n = np.asarray([u.history_tokens for u in users], dtype=np.int64)
    m = np.asarray([u.candidates for u in users], dtype=np.int64)
    first = np.maximum(np.asarray([u.gpu_tokens for u in users], dtype=np.int64), start)
    rows = (n - first + m).sum(axis=1)
    pairs = ((n * (n + 1) - first * (first + 1)) // 2 + m * (n + 1)).sum(axis=1)
    return rows, pairs


def _layers_s(cost: CostModel, rows: np.ndarray, pairs: np.ndarray, buckets: tuple[int, ...] | None) -> np.ndarray:
    """One layer's compute over `rows` rows (as their graph bucket runs them) and `pairs` pairs."""
    return cost.fixed_s + _padded(rows, buckets) * cost.per_row_s + pairs * cost.per_pair_s


def _predict_splits(
    users: list[UserShape], onload: np.ndarray, cost: CostModel, num_layers: int, buckets: tuple[int, ...] | None,
    chunk_tokens: int | None = None, front: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(batch time, total onload time, total compute time, rows that must fit a graph bucket) of
    each of K candidate splits, `onload` [K, users]; front: host_split "compute_front"
    (predict_front; needs chunk_tokens), else the onloaded front (predict). The rows checked against
    the largest bucket are a split's front pass (compute_front) or its batch (load_front).

    Timeline (_timeline): after `first` seconds of work that reads no onloaded page (a front pass),
    L layers, layer i once it and its onloaded tokens' copies are done. Onloaded tokens of
    hidden-state chunks move hidden_bytes_per_token_layer each, the others bytes_per_token_layer."""
    host = np.asarray([u.host_tokens for u in users], dtype=np.int64)
    if front:
        fronts = np.where((onload > 0) & (onload < host), _front(host, onload, chunk_tokens), 0)
        f_rows = fronts.sum(axis=1)
        front_layer = _layers_s(cost, f_rows, (fronts * (fronts + 1) // 2).sum(axis=1), buckets)
        first = np.where(f_rows > 0, cost.front_s + front_layer * num_layers, 0.0)
        # the batch's pass starts after the whole host prefix unless the user recomputes it all
        layer = _layers_s(cost, *_work(users, np.where(onload > 0, host, 0)), buckets)
        loaded_from, loaded_to = fronts, np.where(onload > 0, host, 0)
        fitted_rows = f_rows
    else:
        rows, pairs = _work(users, onload)
        layer = _layers_s(cost, rows, pairs, buckets)
        first = np.zeros(len(onload))
        loaded_from, loaded_to = np.zeros_like(onload), onload
        fitted_rows = rows
    loaded = _loaded_bytes(users, loaded_from, loaded_to, cost, chunk_tokens)
    finish = _timeline(cost, num_layers, loaded, layer, first)
    load = loaded / cost.h2d_bytes_per_s * num_layers
    return finish, load, first + layer * num_layers, fitted_rows


def _loaded_bytes(
    users: list[UserShape], start: np.ndarray, end: np.ndarray, cost: CostModel, chunk_tokens: int | None
) -> np.ndarray:
    """Bytes per layer [K] that K splits onload when user u loads its host tokens [start, end)
    ([K, users] each, chunk-aligned starts): K/V chunks at bytes_per_token_layer a token, hidden
    ones at hidden_bytes_per_token_layer."""
    kv = cost.bytes_per_token_layer
    total = (end - start).sum(axis=1) * kv
    if not cost.hidden_bytes_per_token_layer or not any(u.hidden_chunks for u in users):
        return total.astype(np.float64)
    if not chunk_tokens:
        raise ValueError("hidden-state chunks need chunk_tokens to be priced")
    width = max(len(u.hidden_chunks) for u in users)
    # hidden chunks among each user's first k: min(k, n) for a user whose n chunks all hold hidden
    # states (a user admitted whole, the common case: no per-user count), a running count otherwise
    n = np.asarray([len(u.hidden_chunks) for u in users], dtype=np.int64)
    counts = np.minimum(np.arange(width + 1), n[:, None])
    for i, u in enumerate(users):
        if not all(u.hidden_chunks):
            counts[i, 1 : n[i] + 1] = np.cumsum(np.asarray(u.hidden_chunks, dtype=np.int64))
            counts[i, n[i] + 1 :] = counts[i, n[i]]
    cols = np.arange(len(users))[None, :]
    hi = np.minimum(-(-end // chunk_tokens), width)
    lo = np.minimum(start // chunk_tokens, width)
    hidden_tokens = (counts[cols, hi] - counts[cols, lo]) * chunk_tokens
    hidden_tokens = np.minimum(hidden_tokens, end - start)  # a partial last chunk moves its tokens only
    saved = hidden_tokens.sum(axis=1) * (kv - cost.hidden_bytes_per_token_layer)
    return (total - saved).astype(np.float64)


def _with_compute_margin(cost: CostModel) -> CostModel:
    """The cost model with its layers' compute (in both passes of a front split) compute_margin
    higher: what plan_numpy ranks splits by. front_s, measured beside the layers' model, stays."""
    scale = 1.0 + cost.compute_margin
    return replace(cost, fixed_s=cost.fixed_s * scale, per_row_s=cost.per_row_s * scale, per_pair_s=cost.per_pair_s * scale)


def _timeline(cost: CostModel, num_layers: int, onloaded: np.ndarray, layer_s: np.ndarray, first_s: np.ndarray) -> np.ndarray:
    """The batch's time: after `first_s` of work that reads no onloaded page, L layers of
    `layer_s` each, layer i once it and its `onloaded` bytes per layer have landed:
        finish_i = max(finish_{i-1}, start + (i + 1) * load) + layer,   finish_{-1} = first.
    Unrolled, finish_{L-1} = max(first + L * layer, max_i (start + (i + 1) * load + (L - i) * layer)),
    and the inner term is linear in i, so its max is at i = 0 or i = L - 1: three terms instead of
    a loop over the layers (this runs on the critical path of every host-tier batch)."""
    L = num_layers
    load = onloaded / cost.h2d_bytes_per_s
    start = np.where(onloaded > 0, cost.onload_start_s, 0.0)
    computed = first_s + L * layer_s
    waited = start + np.maximum(load + L * layer_s, L * load + layer_s)
    return cost.forward_s + np.where(onloaded > 0, np.maximum(computed, waited), computed)


def plan(
    users: list[UserShape], cost: CostModel, num_layers: int, chunk_tokens: int, buckets: tuple[int, ...] | None = None,
    front: bool = False,
) -> Plan:
    """plan_numpy's choice, computed in one C++ pass (csrc/split_planner.cpp): it runs on the model
    thread before a host-tier batch's onload starts, where plan_numpy's numpy calls took 0.07 ms at
    batch 1 and 0.10-0.14 ms at batch 8 on the dev CPU. The tests hold both to the same choices."""
    hidden = [u.hidden_chunks for u in users]
    onload, finish, load, compute = _ext.split_plan(
        [u.host_tokens for u in users], [u.gpu_tokens for u in users], [u.history_tokens for u in users],
        [u.candidates for u in users], [len(h) for h in hidden], [() if all(h) else h for h in hidden],
        cost.h2d_bytes_per_s, cost.bytes_per_token_layer, cost.hidden_bytes_per_token_layer, cost.per_row_s,
        cost.per_pair_s, cost.fixed_s, cost.forward_s, cost.onload_start_s, cost.min_gain, cost.front_s, num_layers,
        chunk_tokens, list(buckets or ()), front, cost.compute_margin, cost.margin_window,
    )
    return Plan(onload, finish, load, compute)


def plan_numpy(
    users: list[UserShape], cost: CostModel, num_layers: int, chunk_tokens: int, buckets: tuple[int, ...] | None = None,
    front: bool = False,
) -> Plan:
    """The split minimising the predicted finish; among the splits predicted within
    cost.margin_window of the fastest, the one fastest with its compute priced cost.compute_margin
    higher; ties go to more onload (less GPU work). A split
    (0 < p < n) only if it saves at least cost.min_gain of pure onload's predicted time, else pure
    onload; then pure recompute unless that choice saves cost.min_gain of recomputing's. Both bars
    keep the model's error off the wrong side: on an H100 (2026-12-05) the planner chose onloading
    3,584 of a batch-1 user's 3,968 hidden-state tokens, a split predicted barely apart from pure
    onload, which ran 3.56-3.66 ms against 2.64-2.88 ms for pure onload and 3.37 for recomputing.

    front: splits recompute each prefix's front and onload its back (host_split "compute_front",
    predict_front); else they onload the front and recompute the back (predict).
    buckets: the CUDA-graph row buckets (ascending), when graphs run the batches: a split's rows are
    its bucket's (padded_rows). A split past the largest runs
    eagerly, which the cost model (measured mostly on graph replays) does not describe: on the
    H200 a batch of 8 recomputing half of 4k-token prefixes (18k rows, eager) took 25.7 ms
    against 19.3 ms for a quarter more onload in a graph. Such splits are skipped; pure onload
    and pure recompute always stay candidates.

    Every candidate, fraction k / steps of every host prefix in whole chunks, is predicted at once
    (numpy over candidates and users): one split at a time in Python took 0.2-0.4 ms a batch on
    the dev CPU, on the critical path of every host-tier batch. plan() computes the same choice in
    C++; this form is its reference."""
    steps = max((u.host_tokens // chunk_tokens for u in users), default=0)
    if steps == 0:
        zero = [0] * len(users)
        return Plan(zero, *predict(users, zero, cost, num_layers, buckets))
    chunks = np.asarray([u.host_tokens // chunk_tokens for u in users], dtype=np.int64)
    onload = chunks[None, :] * np.arange(steps, -1, -1, dtype=np.int64)[:, None] // steps * chunk_tokens
    finish, load, compute, rows = _predict_splits(users, onload, cost, num_layers, buckets, chunk_tokens, front)
    ranked = finish
    if cost.compute_margin:
        ranked = _predict_splits(users, onload, _with_compute_margin(cost), num_layers, buckets, chunk_tokens, front)[0]
    split = np.zeros(steps + 1, dtype=bool)
    split[1:-1] = True  # 0 < k < steps: pure onload and pure recompute always stay
    skip = split & (rows > buckets[-1]) if buckets else np.zeros_like(split)
    # Python floats: no numpy scalar per step
    best, times, predicted, skipped = None, ranked.tolist(), finish.tolist(), skip.tolist()
    fastest = min(t for t, s in zip(predicted, skipped) if not s)  # (pure onload and recompute are never skipped)
    near = [not s and t <= fastest * (1 + cost.margin_window) for t, s in zip(predicted, skipped)]
    for i in range(steps + 1):  # k = steps .. 0: ties keep the earlier (more onload)
        if near[i] and (best is None or times[i] < times[best] * (1 - 1e-9)):
            best = i
    recompute, whole = steps, 0  # k = 0, k = steps
    if split[best] and finish[best] > finish[whole] * (1 - cost.min_gain):
        best = whole  # a split's gain over pure onload within the model's error: onload it all
    chosen = best if finish[best] <= finish[recompute] * (1 - cost.min_gain) else recompute
    return Plan([int(t) for t in onload[chosen]], float(finish[chosen]), float(load[chosen]), float(compute[chosen]))
