"""engine/device_launch.py: whole-forward graphs staged and launched from the device.

CPU: the library builds wherever nvcc is (no GPU needed), and without the option or without CUDA
nothing changes. CUDA: outputs equal the host-launched graphs' and the reference, over many
batches rotating every staging slot, with work enqueued after a launch ordered after its forward.
"""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from hstu.engine import RankingEngine, device_launch
from hstu.model.ranking import InferenceRankingGR
from hstu.ops import _build
from hstu.ops.kvcache.config import KVCacheConfig
from hstu.ops.kvcache.manager import AsyncKVCacheManager
from tests.configs import cuda_pipeline_model
from tests.conftest import HistoryBook, rel_err

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_the_library_builds_once_and_exports_its_entry_points(tmp_path, monkeypatch):
    monkeypatch.setenv("HSTU_BUILD_DIR", str(tmp_path))
    path = _build.device_launch_library()
    assert path.exists() and _build.device_launch_library() == path  # cached: the same file, not rebuilt
    lib = ctypes.CDLL(str(path))
    for name in ("hstu_dl_instantiate", "hstu_dl_launcher", "hstu_dl_probe", "hstu_dl_launch", "hstu_dl_destroy"):
        assert hasattr(lib, name), name
    lib.hstu_dl_error_string.restype = ctypes.c_char_p
    assert lib.hstu_dl_error_string(0)  # cudaSuccess has a name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_profiler_ends_the_device_launch_for_good(tmp_path, monkeypatch):
    """Under a profiler a device-side launch failed (run MC), and a serving launcher traps: once one
    has run, every launch goes back to the host, after it too (what it left attached is unknown)."""
    monkeypatch.setenv("HSTU_BUILD_DIR", str(tmp_path))
    launch = device_launch.DeviceLaunch(ctypes.CDLL(str(_build.device_launch_library())), torch.device("cuda", 0))
    assert launch.usable()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not launch.usable()
    assert not launch.usable()


class _FakeFunction:
    """A ctypes function's stand-in: takes restype and argtypes, launches nothing."""


def _launcher_without_a_library() -> device_launch.DeviceLaunch:
    names = ("hstu_dl_error_string", "hstu_dl_instantiate", "hstu_dl_launcher", "hstu_dl_probe", "hstu_dl_launch",
             "hstu_dl_destroy")
    library = type("FakeLibrary", (), {name: _FakeFunction() for name in names})()
    return device_launch.DeviceLaunch(library, torch.device("cuda", 0))


def test_a_profiler_seen_by_one_launcher_ends_every_launchers_device_launch():
    """`hstu bench --trace` (run MN): the uncached engine's launcher saw the profiler, then the cached
    engine's, which had not, launched from the device and the context failed. Process-wide now."""
    seen, other = _launcher_without_a_library(), _launcher_without_a_library()
    assert seen.usable() and other.usable()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not seen.usable()
    assert not other.usable() and not seen.usable()
    assert not _launcher_without_a_library().usable()  # a launcher made later too
    device_launch._PROFILED_IN_PROCESS = False  # (as the tests' fixture resets it)
    assert not seen.usable() and other.usable()  # the launcher that saw it keeps the host launch


def test_off_or_without_cuda_there_is_no_device_launch(monkeypatch):
    monkeypatch.setattr(device_launch, "ENABLED", False)
    assert device_launch.DeviceLaunch.create(torch.device("cuda")) is None
    monkeypatch.setattr(device_launch, "ENABLED", True)
    assert device_launch.DeviceLaunch.create(torch.device("cpu")) is None


def _engine(cfg) -> RankingEngine:
    kv = KVCacheConfig.for_model(cfg, page_size=16, num_pages=128, chunk_tokens=32, host_capacity_bytes=32 << 20)
    return RankingEngine(InferenceRankingGR(cfg, device="cuda"), AsyncKVCacheManager(kv, device="cuda"))


@pytest.mark.cuda
@needs_cuda
def test_device_launched_forwards_equal_host_launched_ones_and_the_reference(monkeypatch):
    cfg = cuda_pipeline_model("float32")
    torch.backends.cuda.matmul.allow_tf32 = False
    buckets = (128, 256)
    monkeypatch.setattr(device_launch, "ENABLED", True)
    launched = _engine(cfg)
    launched.enable_cuda_graphs(max_batch=4, buckets=buckets)
    monkeypatch.setattr(device_launch, "ENABLED", False)
    hosted = _engine(cfg)
    hosted.enable_cuda_graphs(max_batch=4, buckets=buckets)
    assert hosted.graphs.device_launch is None
    assert launched.graphs.device_launch is not None, "the device launch was not set up"
    book_d, book_h = HistoryBook(cfg, seed=11), HistoryBook(cfg, seed=11)
    for step in range(16):  # 8 a bucket: every staging slot reused
        users = [step % 5, 5 + step % 3]
        new = 3 + step % 6 + (30 if step % 2 else 0)  # the two buckets in turn: 52-70 rows, then 176-192
        rd = [book_d.request(u, new, 20) for u in users]
        rh = [book_h.request(u, new, 20) for u in users]
        out_d = launched.forward(rd)
        # read on the host with no synchronisation of our own: the engine's copy-out must wait
        assert torch.isfinite(out_d).all()
        assert rel_err(out_d, hosted.forward(rh)) < 1e-5
        assert rel_err(out_d, launched.forward_no_cache(rd)) < 1e-5
    graphs = launched.graphs
    assert all(b.launchers for b in graphs._buckets.values()), f"refused: {graphs.device_launch.refusals}"
    # every batch replayed a whole forward (nothing to onload), each launched from the device
    assert graphs.replays - graphs.segmented_replays - graphs.waited_replays == 16
    assert graphs.device_launches == 16
    launched.close()
    hosted.close()
    assert launched.graphs.device_launch is None  # its execs destroyed


@pytest.mark.cuda
@needs_cuda
def test_a_launcher_stages_its_slot_then_runs_the_graph_before_later_stream_work():
    """The contract alone, without the engine: a graph reading a device buffer, launched from the
    device after the launcher copied a pinned slot into that buffer; work enqueued after the launch
    (a torch op on the same stream) sees the graph's output, launch after launch, slot after slot."""
    launch = device_launch.DeviceLaunch(ctypes.CDLL(str(_build.device_launch_library())), torch.device("cuda"))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        device_buffer = torch.zeros(1024, dtype=torch.uint8, device="cuda")
        slots = [torch.zeros(1024, dtype=torch.uint8, pin_memory=True) for _ in range(3)]
        values = device_buffer.view(torch.float32)
        out = torch.zeros_like(values)
        values.add_(0)  # allocator and kernels settle before the capture
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, stream=stream):
            out.copy_(values * 2 + 1)
        forward = launch.instantiate(graph)
        assert forward is not None, "a graph of elementwise kernels must launch from the device"
        launchers = [launch.launcher(s, device_buffer, forward) for s in slots]
        for step in range(12):
            slot = step % 3
            torch.cuda.current_stream().synchronize()  # the slot's last launch has read it
            slots[slot].view(torch.float32).copy_(torch.arange(256, dtype=torch.float32) + step)
            launch.launch(launchers[slot])
            seen = out.clone()  # enqueued after the launch: must read this step's forward
            expected = (torch.arange(256, dtype=torch.float32) + step) * 2 + 1
            assert torch.equal(seen.cpu(), expected), step
    stream.synchronize()
    launch.close()


@pytest.mark.cuda
@needs_cuda
def test_under_a_profiler_forwards_take_the_host_launch_and_stay_exact(monkeypatch):
    cfg = cuda_pipeline_model("float32")
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setattr(device_launch, "ENABLED", True)
    engine = _engine(cfg)
    engine.enable_cuda_graphs(max_batch=4, buckets=(128,))
    book = HistoryBook(cfg, seed=5)

    def check(user: int) -> None:
        requests = [book.request(user, 4, 8)]
        out = engine.forward(requests)
        torch.cuda.synchronize()
        assert rel_err(out, engine.forward_no_cache(requests)) < 1e-5

    for step in range(3):
        check(step % 2)
    assert engine.graphs.device_launches == 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]):
        check(0)
    check(1)
    assert engine.graphs.device_launches == 3  # host launches since the profiler, no trap
    engine.close()


@pytest.mark.cuda
@needs_cuda
def test_a_launcher_checks_its_blocks():
    launch = device_launch.DeviceLaunch(ctypes.CDLL(str(_build.device_launch_library())), torch.device("cuda"))
    pinned = torch.zeros(64, dtype=torch.uint8, pin_memory=True)
    with pytest.raises(ValueError, match="equal blocks"):
        launch.launcher(pinned, torch.zeros(48, dtype=torch.uint8, device="cuda"), 0)
    with pytest.raises(ValueError, match="pinned"):
        launch.launcher(torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8, device="cuda"), 0)
    launch.close()
