"""serving/config_sources.py: which HSTU_* variables the server reads as settings."""

from __future__ import annotations

import re
from pathlib import Path

from hstu.serving.config_sources import ENV_PREFIX, RESERVED_ENV, field_types, read_env
from hstu.serving.settings import ServerSettings
from hstu.model.config import HSTUConfig

ROOT = Path(__file__).resolve().parents[2]
# an HSTU_* name read by a module itself: flag/number/choice("HSTU_X", ...) (knobs.py) or os.environ.get("HSTU_X")
_READ = re.compile(r"""(?:\b(?:flag|number|choice)\(|environ\.get\(|environ\[)\s*["'](HSTU_[A-Z0-9_]+)["']""")


def _names_read_by_modules() -> set[str]:
    names = set()
    for folder in ("engine", "ops", "model", "serving", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            names.update(_READ.findall(path.read_text()))
    return names


def test_every_variable_a_module_reads_itself_is_reserved_so_the_server_starts_under_it():
    """A knob (HSTU_DEVICE_LAUNCH=0, HSTU_GRAPH_BUCKETS=...) set for `hstu serve` must not be taken
    for a misspelt setting, which makes the server refuse to start."""
    names = _names_read_by_modules()
    assert {"HSTU_DEVICE_LAUNCH", "HSTU_GLUON_STREAM_AUTO", "HSTU_GRAPH_BUCKETS"} <= names  # the scan finds them
    settings = {f"{ENV_PREFIX}{f.upper()}" for f in field_types(ServerSettings)}
    unread = sorted(n for n in names if not n.startswith(RESERVED_ENV) and n not in settings)
    assert not unread, f"read by modules but neither reserved nor a setting: {unread}"
    env = {n: "1" for n in names if n not in settings}
    assert read_env(env, ServerSettings, HSTUConfig) == {}


def test_no_reserved_prefix_shadows_a_setting():
    settings = {f"{ENV_PREFIX}{f.upper()}" for f in field_types(ServerSettings)}
    assert not [s for s in settings if s.startswith(RESERVED_ENV)]
