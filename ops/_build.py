"""Builds and loads the hstu C++/CUDA extension (JIT, cached).

Why JIT: one source tree serves CPU-only CI machines and CUDA hosts; the extension is compiled
on first use with torch.utils.cpp_extension.load, which caches the build keyed by the sources and
flags, so later imports only load the shared object. CUDA sources (csrc/kernels/*.cu) are compiled
only where a CUDA build of torch and nvcc both exist.

Environment:
  HSTU_BUILD_DIR     where builds are cached (default: ~/.cache/hstu_kvcache/<torch version>)
  HSTU_FORCE_CPU=1   build without CUDA sources even where CUDA exists
  HSTU_CUDA_ARCH     gencode arch for nvcc (default 90 -> sm_90)
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_lock = threading.Lock()
_module: ModuleType | None = None


def _csrc_dir() -> Path:
    """The csrc folder: beside ops/ in a checkout, or the installed hstu.csrc package data."""
    if _CSRC.is_dir():
        return _CSRC
    import hstu.csrc

    return Path(hstu.csrc.__file__).resolve().parent


def cuda_build_enabled() -> bool:
    """True when the CUDA kernels are compiled: CUDA torch, a visible GPU toolchain, not forced off."""
    if os.environ.get("HSTU_FORCE_CPU") == "1":
        return False
    if torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    return CUDA_HOME is not None and shutil.which("nvcc", path=os.path.join(CUDA_HOME, "bin")) is not None


def _sources(with_cuda: bool) -> list[str]:
    root = _csrc_dir()
    sources = sorted(root.glob("*.cpp")) + sorted((root / "cache").glob("*.cpp"))
    if with_cuda:
        sources += sorted((root / "kernels").glob("*.cu"))
    return [str(p) for p in sources]


def _build_dir(name: str) -> Path:
    base = os.environ.get("HSTU_BUILD_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "hstu_kvcache" / torch.__version__.replace("+", "_")
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_extension() -> ModuleType:
    """Return the compiled extension, building it on first use (thread-safe, cached on disk)."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        from torch.utils.cpp_extension import load

        with_cuda = cuda_build_enabled()
        name = "hstu_ext_cuda" if with_cuda else "hstu_ext_cpu"
        build_dir = _build_dir(name)
        building = not any(build_dir.glob(f"{name}*.so"))
        if building:
            # measured: CPU-only ~1-3 min on 2 cores; with the CUDA kernels ~35 s on 16 cores (H200 host)
            logger.warning(
                "building hstu ops %s (first run only; %s) in %s; `hstu build-ext` does this ahead of time",
                "with CUDA kernels" if with_cuda else "for CPU",
                "about 35 s on 16 cores, longer on fewer" if with_cuda else "about 1-3 min on 2 cores",
                build_dir,
            )
        started = time.monotonic()
        cflags = ["-O2"]  # the C++ standard is torch's own (cpp_extension adds it); never override it
        cuda_flags = ["-O3", "--use_fast_math", "-lineinfo"]
        arch = os.environ.get("HSTU_CUDA_ARCH", "90")
        cuda_flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
        _module = load(
            name=name,
            sources=_sources(with_cuda),
            extra_cflags=cflags + (["-DHSTU_WITH_CUDA"] if with_cuda else []),
            extra_cuda_cflags=cuda_flags,
            extra_include_paths=[str(_csrc_dir())],
            build_directory=str(build_dir),
            with_cuda=with_cuda,
            verbose=os.environ.get("HSTU_BUILD_VERBOSE") == "1",
        )
        if building:
            logger.warning("hstu ops built in %.0f s", time.monotonic() - started)
        return _module
