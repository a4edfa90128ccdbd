"""Run a test script in a fresh Python under Triton's interpreter (TRITON_INTERPRET=1 must be set
before triton is imported, so never in the test process itself)."""

from __future__ import annotations

import os
import subprocess
import sys


def run_interpreted(code: str, done: str, timeout: int = 600, unset: tuple[str, ...] = ()) -> None:
    """Run `code` with TRITON_INTERPRET=1 (and without the environment variables in `unset`);
    fail with its output unless it exits 0 having printed `done` last."""
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and proc.stdout.strip().endswith(done), proc.stdout[-2000:] + proc.stderr[-4000:]
