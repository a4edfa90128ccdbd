"""Experiment knobs of the kernels, read from the environment once and strictly.

Why strict: a knob exists for same-call comparisons (a run with it, a run without), and a typo in
its value that fell back to the default would record two runs of the same thing as a comparison.
"""

from __future__ import annotations

import math
import os


def flag(name: str, default: bool = False) -> bool:
    """Environment variable `name` as 0 or 1 (unset: default); anything else raises naming it."""
    value = os.environ.get(name, "1" if default else "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Environment variable `name` as one of `choices` (unset or empty: default); anything else
    raises naming it and the choices."""
    value = os.environ.get(name) or default
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def number(name: str, default: float, meaning: str, minimum: float | None = None) -> float:
    """Environment variable `name` as a finite number, at least `minimum` when given (unset:
    default); anything else raises naming it and what it means."""
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not math.isfinite(x) or (minimum is not None and x < minimum):
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise ValueError(f"{name} must be a number{bound} ({meaning}), got {value!r}")
    return x
