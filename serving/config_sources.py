"""Settings from three sources, one set of names: a config file, HSTU_* environment variables and
command-line flags (later wins), onto a frozen dataclass with a nested model section.

    config file (JSON, or TOML where tomllib exists): {"num_pages": 512, "model": {"num_layers": 8}}
    environment:  HSTU_NUM_PAGES=512  HSTU_MODEL__NUM_LAYERS=8
    flags:        --num-pages 512     (the field name with dashes)

Every key must name a field (or a model field under "model"): an unknown key is a ValueError
naming it and its source, so a typo never falls back to a default silently. Environment values are
parsed by the field's type (int, float, bool, str, comma-separated tuple of str).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Mapping

ENV_PREFIX = "HSTU_"
MODEL_SECTION = "model"
# Variables that are not settings: the extension build's (ops/_build.py) and the experiment knobs
# that modules read themselves for same-call A/B runs (the server must start under them).
# Prefixes: the attention kernels' knobs (HSTU_ATTENTION_*, HSTU_GLUON_*) and the onload's.
RESERVED_ENV = (
    "HSTU_BUILD", "HSTU_FORCE_CPU", "HSTU_CUDA_ARCH",
    "HSTU_PIPE_THREADS", "HSTU_REBUILD_AHEAD", "HSTU_REBUILD_GRAPHS", "HSTU_ATTENTION_", "HSTU_GLUON_", "HSTU_ONLOAD_",
    "HSTU_FINISH_WAITS_ONLOAD", "HSTU_LOGITS_OUT", "HSTU_GC_FREEZE", "HSTU_DEVICE_LAUNCH", "HSTU_FUSED_GATE",
    "HSTU_GRAPH_BUCKETS", "HSTU_STAGE_COPY", "HSTU_TEST_KNOB", "HSTU_COMPILE_MODE",
    "HSTU_CHECK_AFTER_LAUNCH", "HSTU_FRONT_FIRST", "HSTU_FEEDBACK_FROM_PLAN", "HSTU_SPLIT_SEGMENTS",
    "HSTU_BLOCKING_WAITS", "HSTU_COMPUTE_MARGIN",
)
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotation of every dataclass field of `cls`."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _parse(text: str, hint: Any, what: str) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and args:
        if text.strip().lower() in ("", "none", "null"):
            return None
        return _parse(text, args[0], what)
    if typing.get_origin(hint) is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    if hint is bool:
        low = text.strip().lower()
        if low in _TRUE | _FALSE:
            return low in _TRUE
        raise ValueError(f"{what}: expected a boolean (1/0, true/false), got {text!r}")
    try:
        return hint(text) if hint in (int, float, str) else text
    except ValueError as exc:
        raise ValueError(f"{what}: expected {hint.__name__}, got {text!r}") from exc


def read_file(path: str | Path) -> dict[str, Any]:
    """The settings document of a JSON or TOML file; ValueError naming the file if unreadable."""
    path = Path(path)
    try:
        text = path.read_text()
        if path.suffix == ".toml":
            import tomllib

            doc = tomllib.loads(text)
        else:
            doc = json.loads(text)
    except (OSError, ValueError, ImportError) as exc:
        raise ValueError(f"config file {str(path)!r} cannot be read: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"config file {str(path)!r} must hold an object, got {type(doc).__name__}")
    return doc


def read_env(env: Mapping[str, str], cls: type, model_cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """HSTU_FIELD and HSTU_MODEL__FIELD variables as a settings document (typed); fields named in
    `skip` (objects, not values) are not settable this way."""
    types, model_types = field_types(cls), field_types(model_cls)
    doc: dict[str, Any] = {}
    model_prefix = f"{ENV_PREFIX}{MODEL_SECTION.upper()}__"
    for key, text in env.items():
        if not key.startswith(ENV_PREFIX) or key.startswith(RESERVED_ENV):
            continue
        if key.startswith(model_prefix):
            name = key[len(model_prefix) :].lower()
            if name not in model_types:
                raise ValueError(f"environment variable {key} names no model field")
            doc.setdefault(MODEL_SECTION, {})[name] = _parse(text, model_types[name], key)
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in types or name in skip:
            raise ValueError(f"environment variable {key} names no setting")
        doc[name] = _parse(text, types[name], key)
    return doc


def check_keys(doc: Mapping[str, Any], cls: type, model_cls: type, source: str, skip: tuple[str, ...] = ()) -> None:
    """ValueError naming the first key of `doc` that is no field (nor a model field under "model")."""
    names = (set(field_types(cls)) - set(skip)) | {MODEL_SECTION}
    unknown = sorted(set(doc) - names)
    if unknown:
        raise ValueError(f"{source}: unknown settings {unknown}")
    model = doc.get(MODEL_SECTION, {})
    if not isinstance(model, dict):
        raise ValueError(f"{source}: the {MODEL_SECTION!r} section must be an object")
    unknown = sorted(set(model) - set(field_types(model_cls)))
    if unknown:
        raise ValueError(f"{source}: unknown model settings {unknown}")


def merge(*docs: Mapping[str, Any]) -> dict[str, Any]:
    """Later documents win, key by key; the model sections merge key by key too."""
    out: dict[str, Any] = {}
    for doc in docs:
        for key, value in doc.items():
            if key == MODEL_SECTION:
                out[MODEL_SECTION] = {**out.get(MODEL_SECTION, {}), **value}
            else:
                out[key] = value
    return out
