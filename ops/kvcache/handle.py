"""OnloadHandle: per-layer completion of one batch's host->GPU onload.

The onload marks layer i ready after enqueueing its copies (recording a CUDA event on the onload
stream; the model thread enqueues them, TierTransfers.onload_async); the compute thread's wait(i)
blocks until then and, on CUDA, makes the current stream wait on that event - so layer i waits
only for its own pages and the host never syncs on the copy. Once every layer is enqueued without
error the handle is `enqueued`: finish() commits the batch then, without waiting for the copies to
land (the device runs everything that reads the pages after them, in stream order). The onload
worker then waits for this batch's last event (not the streams: later onloads' copies may be queued
there) and marks it done. A handle belongs to one batch and is never reset: a new batch gets a new
handle, so a late onload cannot signal the wrong batch.
"""

from __future__ import annotations

import threading

import torch

from hstu.ops import knobs

# HSTU_BLOCKING_WAITS=1: the cache's workers (an onload's settle, an offload, a prefetch) wait for their
# copies on blocking-sync events (cudaEventBlockingSync), asleep, instead of in the CUDA driver's spin on
# a CPU core (its default while a process has fewer contexts than cores), which lasts as long as the
# copies: ~10 ms a host-tier batch of 8. Why it may matter: on an H100 host (runs MU-MW) whole processes
# ran the model thread's host work 1.5-1.7x slower than others; a core kept spinning beside it is one
# suspect. The cost: a sleeping worker wakes tens of microseconds later, which a batch sees only where
# its plan joins a worker still busy with one of its users (transfers.join). An experiment knob until
# measured.
BLOCKING_WAITS = knobs.flag("HSTU_BLOCKING_WAITS")


def worker_event() -> "torch.cuda.Event":
    """An event a worker thread may wait on (blocking-sync under HSTU_BLOCKING_WAITS)."""
    return torch.cuda.Event(blocking=BLOCKING_WAITS)


def wait_stream(stream: "torch.cuda.Stream") -> None:
    """A worker's wait for the work enqueued so far on `stream`: stream.synchronize(), or asleep on
    a blocking-sync event recorded there under HSTU_BLOCKING_WAITS."""
    if not BLOCKING_WAITS:
        stream.synchronize()
        return
    done = worker_event()
    done.record(stream)
    done.synchronize()


class OnloadHandle:
    def __init__(self, num_layers: int, device: torch.device, timeout_s: float = 60.0) -> None:
        self.num_layers = num_layers
        self.timeout_s = timeout_s
        # layers [0, _ready_upto) are enqueued: they are marked in order (copies, then rebuilds, layer
        # by layer), so one count and one condition serve where a threading.Event a layer cost
        # ~6 us each to make, 50 us of a host-tier batch's plan on the dev CPU; the two later states
        # (every layer enqueued or failed; the worker done) are flags under the same condition, not
        # two more Events (2.5 against 8 us to make the handle's sync objects, dev CPU)
        self._ready_upto = 0
        self._ready = threading.Condition(threading.Lock())
        self._events = [worker_event() for _ in range(num_layers)] if device.type == "cuda" else None
        self._enqueued = False
        # events recorded with each layer's own (ForwardGraphs.layer_ready: a CUDA graph's waits);
        # set before the onload starts
        self.mirror: list | None = None
        self._done = False
        self.error: BaseException | None = None
        self._compute: "torch.cuda.Stream | None" = None

    @classmethod
    def completed(cls, num_layers: int) -> "OnloadHandle":
        """A handle for a batch with nothing to onload: one shared instance per layer count (nine
        threading objects cost ~20 us a batch; a completed handle never changes, since only an onload
        (TierTransfers) marks or fails a handle, and none gets this one)."""
        handle = _COMPLETED.get(num_layers)
        if handle is None:
            handle = cls(num_layers, torch.device("cpu"))
            handle._ready_upto = num_layers
            handle._enqueued = handle._done = True
            handle = _COMPLETED.setdefault(num_layers, handle)
        return handle

    def mark_ready(self, layer: int, stream: "torch.cuda.Stream | None" = None) -> None:
        """Worker side: layer's copies are enqueued (CUDA: on `stream`) or done (CPU); layers are
        marked in order, so every earlier one was."""
        if self._events is not None and stream is not None:
            self._events[layer].record(stream)
            if self.mirror is not None:
                self.mirror[layer].record(stream)
        with self._ready:
            self._ready_upto = max(self._ready_upto, layer + 1)
            self._ready.notify_all()

    def mark_enqueued(self) -> None:
        """Model thread: every layer's copies (and rebuilds) are enqueued without error."""
        self._set(enqueued=True)

    def _set(self, enqueued: bool = False, done: bool = False) -> None:
        with self._ready:
            self._enqueued = self._enqueued or enqueued
            self._done = self._done or done
            self._ready.notify_all()

    def synchronize(self) -> None:
        """Worker side: block until this batch's copies and rebuilds completed on the device: its last
        layer's event, recorded after them (each layer's follows the layer's copies on the copy stream
        or its rebuild on the rebuild stream, which waited for them). No-op off CUDA."""
        events = self._events
        if events is not None:
            events[-1].synchronize()

    def mark_done(self) -> None:
        self._set(done=True)

    def fail(self, error: BaseException) -> None:
        """Worker side: onload failed; releases every waiter. Pages of this batch's onloaded users are garbage."""
        self.error = error
        self._events = None
        with self._ready:
            self._ready_upto = self.num_layers
            self._enqueued = self._done = True
            self._ready.notify_all()

    def wait(self, layer: int) -> None:
        """Compute side: block until layer's onload is enqueued, then order the current stream after it."""
        if self._ready_upto <= layer and not self._wait_for(lambda: self._ready_upto > layer):
            raise TimeoutError(f"onload of layer {layer} did not start within {self.timeout_s:.0f}s")
        events = self._events
        if events is not None:
            # the compute stream, looked up once a batch (every wait runs on the model thread, in it)
            if self._compute is None:
                self._compute = torch.cuda.current_stream()
            self._compute.wait_event(events[layer])

    def _wait_for(self, predicate) -> bool:
        """Block until predicate() (read under the condition) holds; False on timeout."""
        with self._ready:
            return self._ready.wait_for(predicate, self.timeout_s)

    def wait_enqueued(self) -> bool:
        """Block until every layer is enqueued (True) or the onload failed (False: done, its copies
        settled; the caller recomputes the users)."""
        if not self._enqueued and not self._wait_for(lambda: self._enqueued):
            raise TimeoutError(f"onload was not enqueued within {self.timeout_s:.0f}s")
        return self.error is None

    def wait_done(self) -> None:
        """Block until the worker finished with this handle (copies enqueued and host pins released)."""
        if not self._done and not self._wait_for(lambda: self._done):
            raise TimeoutError(f"onload did not finish within {self.timeout_s:.0f}s")

    @property
    def failed(self) -> bool:
        return self.error is not None


_COMPLETED: dict[int, OnloadHandle] = {}  # OnloadHandle.completed's instances, by layer count
