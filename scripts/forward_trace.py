"""One call under torch.profiler, summarised on one clock: when its host span started and ended,
the CUDA runtime calls every thread made during it, and each stream's device activity, all in
microseconds from the call's start.

Why: an event-timed forward (scripts/timing.py) says how long it took, not where the time went. The
profile harness (`hstu profile`) times forwards of its own, which differ from `hstu bench`'s
(requests not hashed before, no other pass between them); a bench forward traced here shows the
host work before the GPU's first kernel, the launch gaps and anything after the logits in the
benchmark's own setting. Compact (no Chrome trace): it goes into bench.json."""

from __future__ import annotations

from typing import Any, Callable

import torch

from hstu.scripts.profile_forward import is_runtime_call, stream_timeline

_MARK = "forward_trace.call"
_MAX_HOST_CALLS = 200


def traced_call(fn: Callable[[], Any], device: torch.device, min_call_us: float = 3.0) -> tuple[Any, dict]:
    """(fn()'s result, its trace): {"call_us": [0, end], "host_calls": [[start, end, name, thread]...]
    (runtime calls of at least min_call_us, at most 200), "streams": {stream: [[start, end, kind,
    events]...]} (profile_forward.stream_timeline)}. The current stream is synchronised before the
    profiler stops, so the call's kernels are in the trace. On a CPU: the result and an empty dict."""
    if device.type != "cuda":
        return fn(), {}
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(_MARK):
            result = fn()
        torch.cuda.current_stream(device).synchronize()
    events = prof.events()
    marks = [e for e in events if e.name == _MARK]
    if not marks:
        return result, {}
    t0, t1 = marks[0].time_range.start, marks[0].time_range.end
    calls = sorted(
        (e for e in events if is_runtime_call(e) and e.time_range.end - e.time_range.start >= min_call_us),
        key=lambda e: e.time_range.start,
    )
    device_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return result, {
        "call_us": [0.0, round(t1 - t0, 1)],
        "host_calls": [
            [round(e.time_range.start - t0, 1), round(e.time_range.end - t0, 1), e.name, e.thread]
            for e in calls[:_MAX_HOST_CALLS]
        ],
        "streams": stream_timeline(device_events, origin=t0),
    }
