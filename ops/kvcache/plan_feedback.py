"""What host-tier batches measured against the planner's prediction, fed back into its next choices.

Why: the planner's cost model is a fit of a few start-up shapes, and it has been wrong in one
direction where it matters most. At batch 1 a split was predicted 13% faster than recomputing
and measured 16% slower (H100 run GA: 3.25 ms against 2.81 for no cache); the H200 (runs BA, BB)
and an H100 with hidden-state chunks (2026-12-05) missed the same way. "Never slower than no
cache" cannot rest on a model alone, so every host-tier batch's time is measured and compared
with what was predicted for it, per kind of choice (split, whole onload, recompute) and batch
size: a moving average of measured / predicted. Before a batch runs a plan other than
recomputing, the planner's choice is re-priced with those factors against recomputing (and a
whole onload), so a kind that measured slower than it was predicted stops being chosen where
recomputing is cheaper. Recomputing is always allowed, so a vetoed kind is not measured again
at that size (it was a loss: it stays off).

What is measured is the batch's plan and layers: on CUDA two events on the compute stream, one
recorded before the plan (mark) and one after the forward (the span from where the stream reached
the batch, so a batch queued behind another is charged only for the part of its plan the GPU
idled through, to its logits), read once complete at a later plan; on a CPU the plan's and
forward's wall time. Both are compared with the prediction less forward_s (the per-forward
cost), and a re-priced plan keeps forward_s as predicted. The plan is in the span because it
differs by kind: on an H100 (run MK) a batch-1 front split planned and packed its two passes in
0.88-1.25 ms against 0.65 for a load_front split; measured from after the plan, front splits
kept a factor that priced them below load_front's and took 11 of 13 batches, at 0.84-0.95x of no
cache (2.84-3.24 ms; the same bench took load_front's split in its other runs, 2.18-2.57 ms).
HSTU_FEEDBACK_FROM_PLAN=0 (engine.py) measures from after the plan, as before.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

from hstu.ops.kvcache.planner import CostModel, Plan, UserShape, predict

KINDS = ("split", "front", "onload", "recompute")


def plan_kind(onload: list[int], host_tokens: list[int], front: bool = False) -> str:
    """The kind of a plan onloading onload[u] of each host-tier user's host_tokens[u]; a split
    whose users recompute fronts in a pass of their own (front: host_split compute_front, some
    user split within its prefix) is "front": its timeline is another one."""
    pairs = [(p, n) for p, n in zip(onload, host_tokens) if n > 0]
    if all(p == 0 for p, _ in pairs):
        return "recompute"
    if all(p == n for p, n in pairs):
        return "onload"
    return "front" if front and any(0 < p < n for p, n in pairs) else "split"


@dataclass
class _Pending:
    kind: str
    users: int
    predicted_s: float  # the layers' part of the prediction
    start: "torch.cuda.Event | None"
    end: "torch.cuda.Event | None"


class PlanFeedback:
    """Moving averages of measured / predicted per (kind, batch users), bounded to [low, high];
    1.0 until a kind was measured at a size. alpha: the weight of each new batch. Thread-safe:
    batches are recorded on the model thread and the factors read by metrics."""

    def __init__(self, alpha: float = 0.3, low: float = 0.5, high: float = 4.0, max_pending: int = 64) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0.0 < low <= 1.0 <= high:
            raise ValueError(f"need 0 < low <= 1 <= high, got low {low}, high {high}")
        self.alpha, self.low, self.high = alpha, low, high
        self._factors: dict[tuple[str, int], float] = {}
        self._counts: dict[tuple[str, int], int] = {}
        # batches recorded, not yet read; past max_pending in flight the oldest goes unmeasured
        self._pending: deque[_Pending] = deque(maxlen=max_pending)
        self._lock = threading.Lock()
        self._model: object = None

    def follow(self, model: object) -> None:
        """Start over when the cost model the predictions come from changed (a new calibration):
        factors measured against another model's predictions mean nothing for this one's."""
        if model != self._model:
            with self._lock:
                self._factors.clear()
                self._counts.clear()
                self._pending.clear()
                self._model = model

    def factor(self, kind: str, users: int) -> float:
        """measured / predicted of `kind` at this batch size so far (1.0 when never measured)."""
        self.collect()
        with self._lock:
            return self._factors.get((kind, users), 1.0)

    def measured(self, kind: str, users: int) -> bool:
        """Whether a batch of `kind` at this size was measured (its events read)."""
        self.collect()
        with self._lock:
            return (kind, users) in self._factors

    def observe(self, kind: str, users: int, predicted_s: float, measured_s: float) -> None:
        """Fold one batch's measured seconds against its predicted ones (both the layers' part)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if not predicted_s > 0 or not measured_s >= 0:
            return  # nothing predicted to compare with (a model without layer costs)
        ratio = min(self.high, max(self.low, measured_s / predicted_s))
        key = (kind, users)
        with self._lock:
            old = self._factors.get(key)
            self._factors[key] = ratio if old is None else old + self.alpha * (ratio - old)
            self._counts[key] = self._counts.get(key, 0) + 1

    @staticmethod
    def mark(device: torch.device) -> "torch.cuda.Event | None":
        """A start event recorded on the current stream now (CUDA; None elsewhere), for begin()."""
        if device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(
        self, kind: str, users: int, predicted_s: float, device: torch.device, start: "torch.cuda.Event | None" = None
    ) -> _Pending:
        """A batch about to run on `device`: on CUDA, its start event (`start`, recorded by mark()
        before its plan, else recorded on the current stream now); end() records its end."""
        if start is None:
            start = self.mark(device)  # (None off CUDA)
        return _Pending(kind, users, predicted_s, start, torch.cuda.Event(enable_timing=True) if start is not None else None)

    def end(self, pending: _Pending, wall_s: float) -> None:
        """The batch's work is enqueued (CUDA: its end event recorded now, read by a later
        collect()) or done (CPU: wall_s is its forward's time)."""
        if pending.end is None:
            self.observe(pending.kind, pending.users, pending.predicted_s, wall_s)
            return
        pending.end.record()
        with self._lock:
            self._pending.append(pending)

    def collect(self) -> None:
        """Fold every recorded batch whose end event completed, oldest first (never blocks)."""
        while True:
            with self._lock:
                if not self._pending or not self._pending[0].end.query():
                    return
                done = self._pending.popleft()
            self.observe(done.kind, done.users, done.predicted_s, done.start.elapsed_time(done.end) / 1e3)

    def as_dict(self) -> dict[str, dict[str, float]]:
        """{"<kind>@<users>": {"factor", "batches"}} for metrics."""
        self.collect()
        with self._lock:
            return {f"{k}@{b}": {"factor": f, "batches": self._counts[(k, b)]} for (k, b), f in sorted(self._factors.items())}


def reprice(
    chosen: Plan, kind: str, shapes: list[UserShape], cost: CostModel, feedback: PlanFeedback, num_layers: int,
    chunk_tokens: int, buckets: tuple[int, ...] | None = None,
) -> tuple[Plan, str]:
    """(plan, kind): the planner's `chosen` plan, of `kind` (plan_kind), unless, with each kind's
    layers priced by its measured factor, recomputing (or onloading every prefix whole) is
    predicted cheaper; the same min_gain bar as the planner's keeps any plan but recomputing only
    where it saves that share. Re-priced only once the chosen kind measured more than min_gain
    slower than predicted (and than recomputing did): below that the planner's own margin covers
    the error, and what the span measures beyond the layers (the embedding and head kernels, a
    few % of a batch) cannot flip a choice. Costs two dict reads otherwise.

    Past that bar with recomputing never measured at this batch size, the batch recomputes: a
    probe, so both sides of the comparison are measured. Why: on an H100 (run GC) a batch-1 split
    measured ~1.25x its predicted layers, while recomputing, predicted 0.3 ms slower than it ran,
    kept the prior 1.0; priced so, the split still passed the bar and ran 0.87x of no cache. A
    probe costs at most what no cache costs (recomputing is what no cache does)."""
    if kind == "recompute":
        return chosen, kind
    users = len(shapes)
    if feedback.factor(kind, users) <= max(1.0, feedback.factor("recompute", users)) * (1 + cost.min_gain):
        return chosen, kind
    zero = [0] * users
    if not feedback.measured("recompute", users):
        return Plan(zero, *predict(shapes, zero, cost, num_layers, buckets, chunk_tokens)), "recompute"
    plans = {kind: chosen}
    for other, onload in (("onload", [s.host_tokens for s in shapes]), ("recompute", zero)):
        if other not in plans:
            plans[other] = Plan(onload, *predict(shapes, onload, cost, num_layers, buckets, chunk_tokens))
    priced = {k: cost.scaled(p.predicted_s, feedback.factor(k, users)) for k, p in plans.items()}
    bar = priced["recompute"] * (1 - cost.min_gain)
    best = min((k for k in plans if k != "recompute" and priced[k] <= bar), key=priced.get, default="recompute")
    return plans[best], best
