"""The onload handle's worker-side waits (HSTU_BLOCKING_WAITS): what a worker's wait for a stream does."""

import pytest
import torch

from hstu.ops.kvcache import handle


class _Event:
    """torch.cuda.Event's part a worker's wait uses, recording what was done to it."""

    made: list["_Event"] = []

    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.blocking, self.calls = blocking, []
        _Event.made.append(self)

    def record(self, stream=None) -> None:
        self.calls.append(("record", stream))

    def synchronize(self) -> None:
        self.calls.append("synchronize")


class _Stream:
    def __init__(self) -> None:
        self.synchronized = False

    def synchronize(self) -> None:
        self.synchronized = True


@pytest.fixture
def events(monkeypatch):
    _Event.made = []
    monkeypatch.setattr(handle.torch.cuda, "Event", _Event)
    return _Event.made


def test_a_workers_wait_synchronizes_the_stream_by_default(monkeypatch, events):
    monkeypatch.setattr(handle, "BLOCKING_WAITS", False)
    stream = _Stream()
    handle.wait_stream(stream)
    assert stream.synchronized and not events
    assert not handle.worker_event().blocking


def test_blocking_waits_sleep_on_a_blocking_event_recorded_on_the_stream(monkeypatch, events):
    monkeypatch.setattr(handle, "BLOCKING_WAITS", True)
    stream = _Stream()
    handle.wait_stream(stream)
    assert not stream.synchronized
    assert len(events) == 1 and events[0].blocking and events[0].calls == [("record", stream), "synchronize"]
    # the handle's layer events, the last of which the onload's settle waits on, are made the same way
    h = handle.OnloadHandle(3, torch.device("cuda"))
    assert len(events) == 4 and all(e.blocking for e in events[1:])
    h.synchronize()
    assert events[-1].calls == ["synchronize"]


def test_an_onload_handle_off_cuda_has_no_events(events):
    h = handle.OnloadHandle(2, torch.device("cpu"))
    h.synchronize()  # a no-op
    assert not events
