"""hstu build-ext --check-cuda: CUDA sources compiled against torch's headers without a GPU."""

from __future__ import annotations

import shutil

import pytest

from hstu.ops import _build


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_cuda_source_that_does_not_compile_is_named_with_nvccs_error(tmp_path, monkeypatch):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "broken.cu").write_text("int f() { return undeclared_name; }\n")
    monkeypatch.setattr(_build, "_csrc_dir", lambda: tmp_path)
    with pytest.raises(RuntimeError, match=r"nvcc failed on .*broken\.cu(.|\n)*undeclared_name"):
        _build.check_cuda_sources()


def test_without_nvcc_the_check_says_so(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    with pytest.raises(RuntimeError, match="nvcc not found"):
        _build.check_cuda_sources()
