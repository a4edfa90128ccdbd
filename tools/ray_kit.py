"""Build `.rayk/`: the wheels that let `hstu serve --replicas` run on the lent GPU machine.

Why: that machine has no network and takes at most 64 MiB of carried files per call; the ray wheel
alone is 79 MB. Ray Serve needs neither Ray's Java jars, RLlib, Data, Train, Tune, LLM nor the
dashboard's web client, so the wheel is repacked without them (a new RECORD, LZMA) to ~25 MiB, and
only the dependencies Serve's processes were seen to import are added (traced on Python 3.12,
session 16). grpcio and protobuf are carried too: grpcio-reflection needs grpcio >= its own
version, and the machine's grpcio (1.84.0) refused it (run AZ).

    python3 tools/ray_kit.py .rayk        # here, with network; then carry [".whl", ".rayk"]
    python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl .rayk/*.whl   # there
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

RAY = "ray==2.60.0"
DEPENDENCIES = (
    "aiohttp_cors==0.8.1", "colorful==0.5.8", "googleapis-common-protos==1.76.0", "grpcio-reflection==1.85.1",
    "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "opencensus==0.11.4", "opencensus-context==0.1.3",
    "opentelemetry-exporter-prometheus==0.66b2", "opentelemetry-proto==1.45.2", "opentelemetry-sdk==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2", "referencing==0.37.0", "rpds-py==0.30.0", "watchfiles==1.3.0",
    "websockets==17.4", "grpcio==1.85.3", "protobuf==7.36.2",
)
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", "--no-deps"] + [
    arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
    for arg in ("--platform", tag)
]
# Parts of the ray wheel Serve never imports (checked by running an ingress, a handle call and a
# custom request router on Python 3.12 with only these removed).
DROPPED = (
    "ray/jars/", "ray/rllib/", "ray/data/", "ray/llm/", "ray/train/", "ray/tune/", "ray/serve/llm/",
    "ray/dashboard/client/", "ray/_private/runtime_env/agent/thirdparty_files/",
)


def download(specs: tuple[str, ...] | list[str], dest: Path) -> None:
    subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", *PLATFORM, "-d", str(dest), *specs])


def slim(wheel: Path) -> None:
    """Rewrite `wheel` in place without DROPPED parts, tests and bytecode; RECORD regenerated."""
    out = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_LZMA) as dst:
        infos = [i for i in src.infolist() if not i.is_dir()]
        record = next(i.filename for i in infos if i.filename.endswith(".dist-info/RECORD"))
        lines = []
        for info in sorted(infos, key=lambda i: (".dist-info/" in i.filename, i.filename)):
            name = info.filename
            if name == record or name.startswith(DROPPED) or "/tests/" in name or "__pycache__" in name:
                continue
            data = src.read(name)
            entry = zipfile.ZipInfo(name, date_time=info.date_time)
            entry.external_attr, entry.compress_type = info.external_attr, zipfile.ZIP_LZMA
            dst.writestr(entry, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{name},sha256={digest},{len(data)}")
        entry = zipfile.ZipInfo(record, date_time=(2026, 1, 1, 0, 0, 0))
        entry.external_attr, entry.compress_type = 0o644 << 16, zipfile.ZIP_LZMA
        dst.writestr(entry, "\n".join(lines + [f"{record},,"]) + "\n")
    out.replace(wheel)


def main(dest: str = ".rayk") -> int:
    folder = Path(dest)
    folder.mkdir(parents=True, exist_ok=True)
    download([RAY], folder)
    download(list(DEPENDENCIES), folder)
    for wheel in folder.glob("ray-*.whl"):
        slim(wheel)
    total = sum(f.stat().st_size for f in folder.glob("*.whl"))
    print(f"{folder}: {total / 2**20:.1f} MiB of wheels")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
