"""The `hstu` command itself: --version, --log-level anywhere, and `python -m hstu` as the same command."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from hstu import __version__
from hstu.cli import build_parser, main


def test_version_prints_the_package_version_and_exits_0(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"hstu {__version__}"


def test_python_dash_m_hstu_is_the_hstu_command():
    done = subprocess.run([sys.executable, "-m", "hstu", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"hstu {__version__}"


_REQUIRED = {
    "loadgen": ["--server", "http://127.0.0.1:1"],
    "import-checkpoint": ["src", "dst", "--format", "nvidia", "--num-heads", "2"],
    "export": ["--out", "model.pt2"],
}


@pytest.mark.parametrize("command", ["serve", "replay", "bench", "loadgen", "profile", "import-checkpoint", "export"])
def test_log_level_is_accepted_before_and_after_each_subcommand(command):
    parser = build_parser(command)
    rest = _REQUIRED.get(command, [])
    assert parser.parse_args([command, *rest, "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "WARNING", command, *rest]).log_level == "WARNING"
    assert parser.parse_args([command, *rest]).log_level == "INFO"


def test_serve_and_replay_share_option_names_for_shared_settings():
    """One name per setting across entry points (the replay's old names stay as aliases)."""
    def options(cmd: str) -> set[str]:
        sub = next(a for a in build_parser(cmd)._actions if isinstance(a, argparse._SubParsersAction))
        return {o for a in sub.choices[cmd]._actions for o in a.option_strings}

    names = {cmd: options(cmd) for cmd in ("serve", "replay", "bench")}
    shared = {"--config", "--max-batch-size", "--host-cache-mb", "--page-size", "--num-pages", "--chunk-tokens",
              "--cuda-graphs", "--compile", "--device"}
    assert shared <= names["serve"] and shared <= names["replay"]
    assert {"--page-size", "--chunk-tokens", "--cuda-graphs", "--compile", "--device", "--dtype"} <= names["bench"]


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["loadgen", "--help"], ["export", "--help"]])
def test_help_does_not_import_torch(argv):
    """`hstu --help` and the serving commands' help answer without loading torch (or the bench extra)."""
    code = (
        "import sys\nfrom hstu.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
        "assert not {'torch', 'tqdm', 'matplotlib'} & set(sys.modules), sorted({'torch', 'tqdm', 'matplotlib'} & set(sys.modules))"
    ) % (argv,)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage: hstu" in done.stdout


def test_build_ext_builds_or_finds_the_extension(caplog):
    caplog.set_level("INFO")
    assert main(["build-ext"]) == 0
    assert "hstu ops ready" in caplog.text
