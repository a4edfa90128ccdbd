"""`hstu serve` needs only the `serve` extra: run as a process in which the bench and test
packages cannot be imported, it answers help, readiness and one rank call over loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest

from hstu.scripts.loadtest import wait_until_ready
from tests.configs import SERVING_TINY
from tests.serving.conftest import free_port

# Packages of the bench/test/client/ray extras; the serve process must run without any of them.
_NOT_IN_SERVE = ("tqdm", "matplotlib", "httpx", "pytest", "ray")
_BLOCKING_MAIN = """
import sys

class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not in the serve extra")

sys.meta_path.insert(0, _Block())
from hstu.cli import main
sys.exit(main({argv!r}))
"""


def _hstu_without_other_extras(argv: list[str], **kwargs) -> subprocess.Popen:
    code = _BLOCKING_MAIN.format(blocked=_NOT_IN_SERVE, argv=argv)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def test_serve_help_needs_only_the_serve_extra():
    done = _hstu_without_other_extras(["serve", "--help"])
    out, _ = done.communicate(timeout=120)
    assert done.returncode == 0, out
    assert "usage: hstu serve" in out


def test_serve_replicas_without_the_ray_extra_exits_2_naming_it():
    done = _hstu_without_other_extras(["serve", "--replicas", "2"])
    out, _ = done.communicate(timeout=120)
    assert done.returncode == 2, out
    assert "pip install 'hstu-kvcache[ray]'" in out


@pytest.mark.timeout(300)
def test_serve_ranks_with_only_the_serve_extra(tmp_path):
    config = tmp_path / "model.json"
    config.write_text(json.dumps(SERVING_TINY.to_dict()))
    port = free_port()
    server = _hstu_without_other_extras(
        ["serve", "--host", "127.0.0.1", "--port", str(port), "--config", str(config), "--num-pages", "64", "--page-size", "4",
         "--chunk-tokens", "8"]
    )
    base = f"http://127.0.0.1:{port}"
    failure, answer = None, None
    try:
        wait_until_ready(base, lambda: server.poll() is None, timeout_s=240)
        body = {"user_id": 5, "item_ids": [1, 2, 3], "actions": [0, 1, 0], "timestamps": [10, 20, 30], "candidates": [4, 7]}
        request = urllib.request.Request(f"{base}/v1/rank", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=30).read())
    except (RuntimeError, TimeoutError, OSError) as exc:
        failure = exc
    finally:
        server.terminate()
        output = server.communicate(timeout=60)[0]
    assert failure is None, f"{failure}\n{output}"
    assert [c["item_id"] for c in answer["scores"]] == [4, 7]
    assert all(0 < p < 1 for c in answer["scores"] for p in c["scores"].values())
