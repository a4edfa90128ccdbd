"""The `hstu` command itself: --version, and `python -m hstu` as the same command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hstu import __version__
from hstu.cli import main


def test_version_prints_the_package_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"hstu {__version__}"


def test_python_dash_m_hstu_is_the_hstu_command():
    done = subprocess.run([sys.executable, "-m", "hstu", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"hstu {__version__}"
