"""tools/aoti_runner: the C++ program built with CMake against the installed libtorch ranks the
`hstu export` package without Python, equal to the no-cache oracle, with GPU and host-tier
hits, an invalidated history, evictions and offloads. Slow: the CMake build takes about a minute on 2 cores (the
build folder under HSTU_BUILD_DIR is reused by later runs)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hstu.model.ranking import InferenceRankingGR
from tests.conftest import export_sequence, rel_err

pytestmark = pytest.mark.slow
_SOURCE = Path(__file__).resolve().parents[2] / "tools" / "aoti_runner"
_BUILD_MINUTES = 5


def _build(folder: Path) -> Path:
    prefix = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.utils.cmake_prefix_path)"], check=True, capture_output=True, text=True
    ).stdout.strip()
    for cmd in (
        ["cmake", "-S", str(_SOURCE), "-B", str(folder), f"-DCMAKE_PREFIX_PATH={prefix}"],
        ["cmake", "--build", str(folder), "-j", str(os.cpu_count() or 1)],
    ):
        subprocess.run(cmd, check=True, capture_output=True, timeout=_BUILD_MINUTES * 60)
    return folder / "hstu_aoti_runner"


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> Path:
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        pytest.skip("the C++ runner needs cmake and a C++ compiler")
    base = os.environ.get("HSTU_BUILD_DIR")
    return _build(Path(base) / "aoti_runner" if base else tmp_path_factory.mktemp("aoti_runner"))


def _write_batches(path: Path, batches) -> None:
    """The runner's batches file: one request per line, a blank line after each batch."""
    lines = []
    for requests in batches:
        for r in requests:
            fields = [r.user_id, len(r.contextual), *r.contextual, r.num_events, *r.item_ids, *r.actions, *r.timestamps]
            lines.append(" ".join(map(str, [*fields, len(r.candidates), *r.candidates])))
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def test_cpp_runner_ranks_the_package_like_the_no_cache_oracle(runner, aoti_package, tiny_config, tmp_path):
    batches = export_sequence(tiny_config)
    requests_file = tmp_path / "batches.txt"
    _write_batches(requests_file, batches)
    out = subprocess.run([str(runner), aoti_package, str(requests_file)], check=True, capture_output=True, text=True, timeout=120).stdout

    rows = [[float(x) for x in m.group(1).split(",")] for m in re.finditer(r"^user=\d+ item=\d+ logits=(\S+)$", out, re.M)]
    model = InferenceRankingGR(tiny_config)
    expected = torch.cat([model.forward_no_cache(requests) for requests in batches])
    assert rel_err(torch.tensor(rows), expected) < 1e-5
    counters = dict(re.findall(r"(\w+)=(\d+)", out.splitlines()[-1]))
    assert int(counters["reused_tokens"]) > int(counters["onloaded_tokens"]) > 0
    assert int(counters["evictions"]) > 0 and int(counters["offloaded_chunks"]) > 0 and int(counters["invalidations"]) > 0


def test_cpp_runner_ranks_a_synthetic_workload_without_a_batches_file(runner, aoti_package):
    out = subprocess.run([str(runner), aoti_package], check=True, capture_output=True, text=True, timeout=120).stdout
    assert re.search(r"^batch=7 users=\d candidates=\d+ ms=", out, re.M)
    assert "reused_tokens=" in out.splitlines()[-1]
