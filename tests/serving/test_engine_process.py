"""`hstu serve --engine-process`: the engine in a spawned child, the front end forwarding parsed requests.

The oracle: answers equal the in-process server's and the no-cache model's, over several users
and requests each (cache hits and an incremental request included); metrics, prefetch, drain and
a dead engine behave as documented in serving/engine_process.py."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from hstu.serving.settings import ServerSettings

from .conftest import Timeline, matches_reference, serving, tiny_settings
from .test_incremental import as_events, full_columns, increment

anyio = pytest.mark.anyio
SLOW_START_S = 120.0  # the child imports torch and warms up on a shared 2-core machine


@anyio
@pytest.mark.parametrize("model_on_loop", [False, True], ids=["model-thread", "model-on-loop"])
async def test_the_engine_process_answers_like_the_in_process_server_and_the_no_cache_model(reference, model_on_loop):
    """Also with its batches launched on its event loop's thread (model_on_loop): same answers,
    prefetch and metrics."""
    timelines = [Timeline(60 + u) for u in range(3)]
    settings = tiny_settings(engine_process=True, model_on_loop=model_on_loop)
    async with serving(settings, ready=False) as (app, remote), serving() as (local_app, local):
        await _ready(remote)
        runtime = app.state.runtime
        assert runtime.fingerprint == local_app.state.runtime.fingerprint, "the child serves the same seeded weights"
        answers = {}
        for events in (20, 21, 60):
            bodies = [full_columns(t, events, [1, 2, 3]) for t in timelines]
            got = await asyncio.gather(*(remote.post("/v1/rank", json=b) for b in bodies))
            want = await asyncio.gather(*(local.post("/v1/rank", json=b) for b in bodies))
            for g, w, b in zip(got, want, bodies):
                assert g.status_code == w.status_code == 200, g.text
                g, w = g.json(), w.json()
                for key in ("cached_tokens", "computed_tokens", "history_digest"):
                    assert g[key] == w[key], key
                # Scores within fp32 tolerance, not bit for bit: the two servers may batch the
                # concurrent requests differently.
                assert matches_reference(reference, as_events(b), g) and matches_reference(reference, as_events(b), w)
                answers[b["user_id"]] = g
        assert all(a["cached_tokens"] > 0 for a in answers.values()), "the engine process keeps the users' K/V"
        t = timelines[0]
        inc = await remote.post("/v1/rank", json=increment(t, answers[t.user_id], 70, [4, 5]))
        assert inc.status_code == 200 and matches_reference(reference, as_events(full_columns(t, 70, [4, 5])), inc.json())
        prefetch = await remote.post("/v1/prefetch", json={"user_ids": [t.user_id]})
        assert prefetch.status_code == 200 and prefetch.json()["requested"] == 1
        metrics = (await remote.get("/metrics")).text
        assert 'hstu_batch_size_count{replica="engine"}' in metrics
        for phase in ('{phase="pipe_to_engine",replica="engine"}', '{phase="pipe_from_engine"}', '{phase="rank"}'):
            assert f"hstu_request_phase_seconds_count{phase}" in metrics, phase
        assert "hstu_request_latency_seconds_count" in metrics, "the front end's request metrics stay"
        meta = (await remote.get("/v2/models/hstu")).json()
        assert meta["weights_fingerprint"] == runtime.fingerprint
        process = runtime._process
    assert not process.is_alive() and process.exitcode == 0, "closing the app stops the engine process cleanly"


@anyio
async def test_a_dead_engine_process_answers_503_and_the_server_turns_not_ready():
    async with serving(tiny_settings(engine_process=True), ready=False) as (app, client):
        await _ready(client)
        os.kill(app.state.runtime._process.pid, signal.SIGKILL)
        for _ in range(200):
            if (await client.get("/v2/health/ready")).status_code == 503:
                break
            await asyncio.sleep(0.05)
        assert (await client.get("/v2/health/ready")).status_code == 503
        answer = await client.post("/v1/rank", json=full_columns(Timeline(70), 10, [1]))
        assert answer.status_code == 503 and answer.json()["error"] == "unavailable"


async def _ready(client) -> None:
    from .conftest import wait_ready

    await wait_ready(client, timeout_s=SLOW_START_S)


@anyio
async def test_a_hung_engine_process_still_gets_each_request_an_answer_by_its_deadline():
    async with serving(tiny_settings(engine_process=True, request_timeout_ms=500), ready=False) as (app, client):
        await _ready(client)
        pid = app.state.runtime._process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            started = asyncio.get_running_loop().time()
            answer = await client.post("/v1/rank", json=full_columns(Timeline(71), 10, [1]))
            waited = asyncio.get_running_loop().time() - started
        finally:
            os.kill(pid, signal.SIGCONT)
    assert answer.status_code == 504 and answer.json()["error"] == "timeout"
    assert waited < 5.0, f"answered {waited:.2f}s after sending (deadline 0.5s + 1s grace)"


@anyio
async def test_the_engine_process_ignores_a_ctrl_c_meant_for_the_process_group():
    """A terminal's Ctrl-C reaches the whole group; the front end, not the engine, decides when to stop."""
    async with serving(tiny_settings(engine_process=True), ready=False) as (app, client):
        await _ready(client)
        process = app.state.runtime._process
        os.kill(process.pid, signal.SIGINT)
        os.kill(process.pid, signal.SIGTERM)
        await asyncio.sleep(0.5)
        answer = await client.post("/v1/rank", json=full_columns(Timeline(72), 10, [1]))
        assert answer.status_code == 200 and process.is_alive()
    assert process.exitcode == 0


def test_the_sender_writes_what_queued_meanwhile_in_one_message_and_the_reader_delivers_each_in_order():
    """Under load each write costs the sending thread a turn at its process's GIL: messages that
    queued while one was written go out together, and the reading side hands them to its loop one
    by one, in order, then None at EOF."""
    import pickle
    import threading
    from multiprocessing import Pipe

    from hstu.serving.engine_process import _MANY, _read_into, _Sender

    class HeldConn:
        """Records sends; the first one blocks until released, so more messages queue behind it."""

        def __init__(self) -> None:
            self.sent, self.writing, self.release = [], threading.Event(), threading.Event()

        def send_bytes(self, data: bytes) -> None:
            if not self.sent:
                self.writing.set()
                self.release.wait(5)
            self.sent.append(pickle.loads(data))

    conn = HeldConn()
    sender = _Sender(conn, "test-sender")
    sender.send(("done", 1))
    assert conn.writing.wait(5)
    for rid in (2, 3, 4):
        sender.send(("done", rid))
    conn.release.set()
    sender.close()
    assert conn.sent[0] == ("done", 1)
    assert conn.sent[1:] == [(_MANY, [("done", 2), ("done", 3), ("done", 4)])]

    ours, theirs = Pipe()
    ours.send(("ready", "abc"))
    ours.send((_MANY, [("done", 5), ("done", 6)]))
    ours.close()
    loop = asyncio.new_event_loop()
    got, finished = [], asyncio.Event()

    def handle(message) -> None:
        got.append(message)
        if message is None:
            finished.set()

    try:
        _read_into(theirs, loop, handle, "test-reader")
        loop.run_until_complete(asyncio.wait_for(finished.wait(), 5))
    finally:
        loop.close()
    assert got == [("ready", "abc"), ("done", 5), ("done", 6), None]


def test_the_loop_reads_a_pipe_itself_in_order_until_its_end():
    """model_on_loop: no reader thread; the loop reads each write when the pipe is readable, a
    handler's failure is logged and the rest still delivered, and the end stops the reading."""
    from multiprocessing import Pipe

    from hstu.serving.engine_process import _MANY, _read_on_loop

    ours, theirs = Pipe()
    loop = asyncio.new_event_loop()
    got, finished = [], asyncio.Event()

    def handle(message) -> None:
        got.append(message)
        if message == ("bad",):
            raise RuntimeError("a handler failing")
        if message is None:
            finished.set()

    async def talk() -> None:
        ours.send(("ready", "abc"))
        await asyncio.sleep(0.05)
        ours.send((_MANY, [("bad",), ("done", 5)]))
        ours.send(("done", 6))
        ours.close()
        await asyncio.wait_for(finished.wait(), 5)

    try:
        _read_on_loop(theirs, loop, handle, "test-reader")
        loop.run_until_complete(talk())
        assert not loop.remove_reader(theirs.fileno()), "the end removed the reader"
    finally:
        loop.close()
    assert got == [("ready", "abc"), ("bad",), ("done", 5), ("done", 6), None]


def test_model_on_loop_needs_the_engine_process_and_is_on_with_it_by_default():
    from hstu.serving.cli import settings_from_args
    from tests.serving.test_cli import parse

    with pytest.raises(ValueError, match="model_on_loop runs batches on the engine process's event loop"):
        ServerSettings(model_on_loop=True, engine_process=False)
    assert settings_from_args(parse(["serve", "--engine-process", "--model-on-loop"]), env={}).model_on_loop
    assert settings_from_args(parse(["serve", "--engine-process"]), env={}).model_on_loop
    assert not settings_from_args(parse(["serve", "--engine-process", "--no-model-on-loop"]), env={}).model_on_loop
    assert not settings_from_args(parse(["serve", "--no-engine-process"]), env={}).model_on_loop


def _read_all(conn, count: int) -> list:
    """`count` messages from `conn`, each _MANY write unpacked."""
    from hstu.serving.engine_process import _MANY

    got = []
    while len(got) < count:
        assert conn.poll(5), f"only {len(got)} of {count} messages arrived"
        message = conn.recv()
        got.extend(message[1] if message[0] == _MANY else [message])
    return got


def test_a_small_message_into_an_idle_pipe_is_written_by_the_caller_before_send_returns():
    """No hand-off to the sender thread (and its wait for the GIL) when the write cannot block."""
    from multiprocessing import Pipe

    from hstu.serving.engine_process import _Sender

    ours, theirs = Pipe()
    sender = _Sender(ours, "test-sender")
    try:
        assert sender._direct_limit > 0
        sender.send(("done", 1, "outcome", 0.0))
        assert theirs.poll(0), "written before send() returned"
        assert theirs.recv() == ("done", 1, "outcome", 0.0)
    finally:
        sender.close()


def test_direct_and_queued_writes_keep_the_order_messages_were_sent_in():
    """Messages over the direct limit go through the thread; the small ones sent after them wait
    behind them, so the reader sees every message in order."""
    from multiprocessing import Pipe

    from hstu.serving.engine_process import _Sender

    ours, theirs = Pipe()
    sender = _Sender(ours, "test-sender")
    sender._direct_limit = 1000
    big = b"x" * 5000
    sent = []
    try:
        for i in range(60):
            message = ("rank", i, big) if i % 7 == 0 else ("rank", i)
            sender.send(message)
            sent.append(message)
        assert _read_all(theirs, len(sent)) == sent
    finally:
        sender.close()


def test_a_sender_never_blocks_its_caller_on_a_pipe_nobody_reads():
    """An event loop calls send(): with the other side not reading, the direct writes stop once
    the socket stops polling writable and the thread takes (and blocks on) the rest."""
    import time
    from multiprocessing import Pipe

    from hstu.serving.engine_process import _Sender

    ours, theirs = Pipe()
    sender = _Sender(ours, "test-sender")
    payload = b"y" * (sender._direct_limit // 2)
    sent = [("rank", i, payload) for i in range(200)]  # many times the socket's buffer
    try:
        t0 = time.monotonic()
        for message in sent:
            sender.send(message)
        assert time.monotonic() - t0 < 2.0
        assert _read_all(theirs, len(sent)) == sent
    finally:
        sender.close()


def test_the_direct_limit_is_none_without_a_socket_or_under_the_thread_knob(monkeypatch):
    from multiprocessing import Pipe

    import hstu.serving.engine_process as engine_process

    class NoSocket:
        def send_bytes(self, data: bytes) -> None:
            pass

    assert engine_process._direct_limit(NoSocket()) == 0
    ours, theirs = Pipe()
    assert engine_process._direct_limit(ours) > 0
    monkeypatch.setattr(engine_process, "_PIPE_THREADS", True)
    assert engine_process._direct_limit(ours) == 0


def test_the_loop_reads_a_message_written_in_parts_even_on_a_descriptor_left_non_blocking():
    """uvloop's add_reader (a front end's loop under uvicorn) makes the pipe's descriptor
    non-blocking; a message still arriving must then be waited for, not taken for the pipe's end."""
    import os
    import pickle
    import struct
    import threading
    import time
    from multiprocessing import Pipe

    from hstu.serving.engine_process import _read_on_loop

    ours, theirs = Pipe()
    os.set_blocking(theirs.fileno(), False)  # as uvloop leaves it
    payload = pickle.dumps(("done", 7, b"z" * 100_000))
    frame = struct.pack("!i", len(payload)) + payload
    loop = asyncio.new_event_loop()
    got, finished = [], asyncio.Event()

    def handle(message) -> None:
        got.append(message)
        finished.set()

    def write_in_two_parts() -> None:
        os.write(ours.fileno(), frame[:1000])
        time.sleep(0.2)
        os.write(ours.fileno(), frame[1000:])

    try:
        _read_on_loop(theirs, loop, handle, "test-reader")
        writer = threading.Thread(target=write_in_two_parts)
        writer.start()
        loop.run_until_complete(asyncio.wait_for(finished.wait(), 5))
        writer.join()
    finally:
        loop.close()
    assert got == [("done", 7, b"z" * 100_000)]
