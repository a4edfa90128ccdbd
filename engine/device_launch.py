"""Whole-forward CUDA graphs launched from the device, behind their staging copy (issue 12).

Why: the model thread's cudaGraphLaunch of the whole cached forward (~150 kernel nodes) took
0.13 ms at batch 1 and 0.33 ms at batch 8 (H100, runs IA and LA), and the GPU waited for it, after
the plan, every forward. With this, the thread launches a graph of one kernel per batch: the kernel
copies the batch's staging slot into its bucket's device buffer (what read_pinned did) and
tail-launches the forward graph, instantiated for device launch (csrc/device_launch/device_launch.cu
says how and under which contracts).

Used by ForwardGraphs for its `whole` captures where CUDA is there (HSTU_DEVICE_LAUNCH=0: off); a
graph the driver will not instantiate for device launch (a node kind device graphs do not allow),
or whose launch from the device fails its probe, keeps torch's host launch, as does every launch
once a profiler has run: the option never changes what runs, only who launches it.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from hstu.ops import knobs

logger = logging.getLogger(__name__)
# torch's raw current-stream read (CUDA builds; absent from CPU ones, which never launch here)
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# On by default since session 44 (H100, runs MB and MD): its tests, the GPU pipeline and graph tests
# under it and compute-sanitizer passed, seed replays verified at 0 mismatches, and in two
# alternating passes batch 1 ran 0.93-0.95 against 0.99-1.02 ms, batch 8 2.71-2.77 against 2.87-3.04,
# the batch-8 re-rank 2.12-2.20 against 2.33-2.42. HSTU_DEVICE_LAUNCH=0: torch's host launch.
ENABLED = knobs.flag("HSTU_DEVICE_LAUNCH", default=True)
# Set once any launcher in this process saw a torch profiler running: from then on no launcher of
# the process launches from the device, also one that never saw it (another engine's). While this
# was per launcher, `hstu bench --trace` (run MN, H100) failed with "unspecified launch failure" at
# its first traced batch: it traces the uncached engine's forward (whose launcher sees the profiler
# and host-launches), then the cached engine device-launches its next forward, from execs
# instantiated before the profiler attached. A launcher made after a profiler ran launched fine
# (`hstu profile`'s second batch size, run MP), and host launches of earlier execs did (run MD).
# With the flag process-wide, `hstu bench --trace` passed (run MQ, H100: every batch-8 pass after
# batch 1's traced ones host-launched). (A profiler no launcher sees, started and stopped between
# two launches, is not caught: the serving process runs none.)
_PROFILED_IN_PROCESS = False


class DeviceLaunch:
    """The device-launch library bound to one device; owns every graph exec it made."""

    def __init__(self, library: ctypes.CDLL, device: torch.device) -> None:
        self._lib = library
        device = torch.device(device)
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device(device.type, self._index)  # "cuda" and "cuda:0" compare unequal
        self._execs: list[int] = []
        self.refusals: list[str] = []  # why each refused graph keeps the host launch
        self._profiled = False  # this launcher saw a profiler (kept when a test resets the process's flag)
        vp, ll = ctypes.c_void_p, ctypes.c_longlong
        library.hstu_dl_error_string.restype = ctypes.c_char_p
        library.hstu_dl_error_string.argtypes = [ctypes.c_int]
        library.hstu_dl_instantiate.argtypes = [ctypes.c_int, vp, vp, ctypes.POINTER(vp)]
        library.hstu_dl_launcher.argtypes = [ctypes.c_int, vp, vp, ll, vp, ctypes.POINTER(vp)]
        library.hstu_dl_probe.argtypes = [ctypes.c_int, vp, vp, ctypes.POINTER(ctypes.c_int)]
        library.hstu_dl_launch.argtypes = [vp, vp]
        library.hstu_dl_destroy.argtypes = [vp]
        for fn in ("hstu_dl_instantiate", "hstu_dl_launcher", "hstu_dl_probe", "hstu_dl_launch", "hstu_dl_destroy"):
            getattr(library, fn).restype = ctypes.c_int

    @classmethod
    def create(cls, device: torch.device) -> "DeviceLaunch | None":
        """The device launcher for `device` unless HSTU_DEVICE_LAUNCH=0, where it is a CUDA device
        whose library builds (nvcc); else None (logged), and the graphs keep torch's host launch."""
        if not ENABLED or torch.device(device).type != "cuda":
            return None
        from hstu.ops._build import device_launch_library

        try:
            library = ctypes.CDLL(str(device_launch_library()))
        except (OSError, RuntimeError) as exc:
            logger.warning("the device-launch library is unavailable (%s); forward graphs keep the host launch", exc)
            return None
        return cls(library, device)

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed: {self._lib.hstu_dl_error_string(code).decode()} (cudaError {code})")

    def _stream(self) -> ctypes.c_void_p:
        """The current stream's handle: read raw where torch has the call (as Inductor's launchers
        do), not through a Stream object (~6-9 us of Python a launch on an H100 host, launch_cost)."""
        if _RAW_STREAM is not None:
            return ctypes.c_void_p(_RAW_STREAM(self._index))
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def instantiate(self, graph: torch.cuda.CUDAGraph) -> int | None:
        """An exec of `graph` (captured with keep_graph=True) launchable from the device, uploaded
        on the current stream and probed there once (it replays: call it right after the capture,
        whose inputs its buffers still hold); None when the driver refuses it for device launch or
        the probe's launch fails (logged, kept in refusals)."""
        exec_out, raw = ctypes.c_void_p(), ctypes.c_void_p(int(graph.raw_cuda_graph()))
        code = self._lib.hstu_dl_instantiate(self._index, raw, self._stream(), ctypes.byref(exec_out))
        if code != 0:
            return self._refuse("", code)
        launch_error = ctypes.c_int(0)
        code = self._lib.hstu_dl_probe(self._index, exec_out, self._stream(), ctypes.byref(launch_error))
        if code != 0 or launch_error.value != 0:
            self._lib.hstu_dl_destroy(exec_out)
            return self._refuse("probe: ", code or launch_error.value)
        self._execs.append(exec_out.value)
        return exec_out.value

    def _refuse(self, stage: str, code: int) -> None:
        """Keep and log why a forward graph keeps the host launch."""
        reason = stage + self._lib.hstu_dl_error_string(code).decode()
        self.refusals.append(reason)
        logger.warning("a forward graph cannot be launched from the device (%s); it keeps the host launch", reason)

    def usable(self) -> bool:
        """Whether launches may go through the device now. Not once a torch profiler has run in this
        process, seen by this launcher or any other: under it a device-side launch failed (run MC,
        H100), and after it from a launcher that had not seen it (run MN); a serving launcher
        traps, taking the context with it. The host launch runs the same graphs."""
        global _PROFILED_IN_PROCESS
        if _PROFILED_IN_PROCESS or self._profiled:
            return False
        if torch._C._autograd._profiler_enabled():
            _PROFILED_IN_PROCESS = self._profiled = True
            logger.warning("a profiler is running: forward graphs go back to the host launch for this process")
            return False
        return True

    def launcher(self, staging: torch.Tensor, device_buffer: torch.Tensor, forward: int) -> int:
        """A one-kernel graph that copies the pinned `staging` block into `device_buffer` (same
        bytes, a multiple of 16) and then launches `forward` (an instantiate() exec)."""
        nbytes = staging.numel() * staging.element_size()
        if not staging.is_pinned() or device_buffer.device != self.device:
            raise ValueError(f"a launcher copies pinned host memory to {self.device}; got "
                             f"pinned={staging.is_pinned()}, device buffer on {device_buffer.device}")
        if nbytes != device_buffer.numel() * device_buffer.element_size() or nbytes % 16:
            raise ValueError(f"a launcher copies equal blocks of a multiple of 16 bytes; got {nbytes} bytes of staging "
                             f"for {device_buffer.numel() * device_buffer.element_size()}")
        exec_out = ctypes.c_void_p()
        self._check(
            self._lib.hstu_dl_launcher(self._index, ctypes.c_void_p(staging.data_ptr()),
                                       ctypes.c_void_p(device_buffer.data_ptr()), nbytes, ctypes.c_void_p(forward),
                                       ctypes.byref(exec_out)),
            "building a device launcher",
        )
        self._execs.append(exec_out.value)
        return exec_out.value

    def launch(self, launcher: int) -> None:
        """Enqueue `launcher` (its copy, then its forward) on the current stream."""
        self._check(self._lib.hstu_dl_launch(ctypes.c_void_p(launcher), self._stream()), "a device launcher's launch")

    def close(self) -> None:
        """Destroy every exec made here (the caller synchronised the work that uses them)."""
        execs, self._execs = self._execs, []
        for e in execs:
            self._lib.hstu_dl_destroy(ctypes.c_void_p(e))
