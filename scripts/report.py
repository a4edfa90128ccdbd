"""Reports shared by `hstu bench`, `hstu replay` and `hstu profile`: one text/markdown table
formatter, the number format of their cells, the run's environment, cProfile's top functions and
the JSON file writer."""

from __future__ import annotations

import json
import math
import platform
import pstats
from pathlib import Path
from typing import Any

import torch

from hstu.ops.attention import attention_backend


def fmt(value: Any, spec: str | None = None) -> str:
    """A table cell: "-" for missing/NaN, `spec` when given, else 3 significant digits (thousands
    separated from 1000 on) for floats and separated thousands for ints."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if spec is not None:
        return format(value, spec)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_table(rows: list[list[str]], left: int = 1) -> str:
    """Aligned text table: rows[0] the header, a rule under it; the first `left` columns are
    left-aligned (labels), the rest right-aligned (numbers)."""
    if not rows:
        raise ValueError("format_table needs at least a header row")
    width = len(rows[0])
    if any(len(r) != width for r in rows):
        raise ValueError(f"every row needs {width} cells, got {[len(r) for r in rows]}")
    widths = [max(len(r[i]) for r in rows) for i in range(width)]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def markdown_table(rows: list[list[str]]) -> str:
    """The same rows as a GitHub markdown table (rows[0] the header)."""
    if not rows:
        raise ValueError("markdown_table needs at least a header row")
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def device_tier(device: str) -> str:
    """Name of the first cache tier after the device that holds it ("device-tier (cpu)"): the
    cache's "GPU" tier is wherever the model runs, which on a CPU run is no GPU."""
    return f"device-tier ({device})"


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, host and device of this run, and the attention implementation in force."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        "device": str(device),
    }
    if device.type != "cuda":
        env["attention"] = "torch"
        return env
    props = torch.cuda.get_device_properties(device)
    env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    if attention_backend() == "torch":
        env["attention"] = "torch"
        return env
    try:
        from hstu.ops import triton_attention

        env["attention"] = triton_attention.kernel_in_force(device) if triton_attention.available() else "torch"
    except ImportError as exc:
        env["attention"] = f"torch (triton kernel not importable: {exc})"
    return env


def top_own_time(stats: pstats.Stats, top: int) -> list[tuple[str, int, float, float]]:
    """cProfile's `top` functions by own time: (file:line(name), calls, own s, cumulative s)."""
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [(f"{Path(f).name}:{line}({name})", c[1], c[2], c[3]) for (f, line, name), c in rows]


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write `doc` as indented JSON, creating the parent folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
