"""replay.png: per-request latency against history length, and where each pass's lookups were served.

Left: one point per request (x its history tokens, y its latency) on a log y axis, so one slow
request does not flatten the rest, with the median of each history bin as the trend line. The
y label says what the latency is: the client-observed round trip in server mode, the time of the
batch the request ran in when in-process. Right: each pass's lookups split by the tier that served
them, the device tier named for the device that holds it (a CPU run has no GPU).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hstu.scripts.replay_passes import PassResult
from hstu.scripts.report import device_tier

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red")
HISTORY_BINS = 8


def latency_label(results: list[PassResult]) -> str:
    """The y label, true to how the latencies were measured."""
    if results and all(r.client_observed for r in results):
        return "client-observed request latency (ms, log scale)"
    if any(r.client_observed for r in results):
        return "request latency (ms, log scale; server: client round trip, in-process: batch time)"
    return "request latency = time of its batch (ms, log scale)"


def binned_medians(x: np.ndarray, y: np.ndarray, bins: int = HISTORY_BINS) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres, median y) over `bins` equal-width bins of x; empty bins are left out."""
    if x.size == 0:
        return np.empty(0), np.empty(0)
    edges = np.linspace(x.min(), x.max() + 1, bins + 1)
    which = np.clip(np.digitize(x, edges) - 1, 0, bins - 1)
    full = [b for b in range(bins) if (which == b).any()]
    centres = np.asarray([(edges[b] + edges[b + 1]) / 2 for b in full])
    return centres, np.asarray([np.median(y[which == b]) for b in full])


def _tier_shares(res: PassResult) -> tuple[float, float, float] | None:
    s = res.stats
    lookups = s.get("gpu_hits", 0) + s.get("host_hits", 0) + s.get("misses", 0)
    if not lookups:
        return None
    return s["gpu_hits"] / lookups, s["host_hits"] / lookups, s["misses"] / lookups


def plot_latency(results: list[PassResult], path: Path, title: str, device: str) -> None:
    """Write the two-panel figure to `path` (PNG); `device` names the device tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter

    fig, (ax, tiers) = plt.subplots(1, 2, figsize=(10, 5.6), dpi=120, gridspec_kw={"width_ratios": (3, 1.2)})
    for res, color in zip(results, COLORS):
        if not res.records:
            continue
        x = np.asarray([r.history_tokens for r in res.records], dtype=np.float64)
        y = np.asarray([r.latency_ms for r in res.records], dtype=np.float64)
        ax.scatter(x, y, s=10, alpha=0.35, color=color, linewidths=0,
                   label=f"{res.name}: {len(y)} requests (p50 {np.median(y):.1f} ms)")
        mids, meds = binned_medians(x, y)
        ax.plot(mids, meds, color=color, linewidth=2, marker="o", markersize=3,
                label=f"{res.name}: median per history bin ({HISTORY_BINS} bins)")
    ax.set_yscale("log")
    # Plain numbers ("60", not "6 x 10^1"); minor ticks labelled only when the range is narrow.
    ax.yaxis.set_major_formatter(LogFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_xlabel("history length of the request (tokens)")
    ax.set_ylabel(latency_label(results))
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.35, which="major")
    ax.grid(alpha=0.12, which="minor")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, frameon=False)

    names, shares = [], []
    for res in results:
        share = _tier_shares(res)
        if share is not None:
            names.append(res.name)
            shares.append(share)
    bottom = np.zeros(len(names))
    for i, (label, color) in enumerate(
        ((f"{device_tier(device)} hit", "tab:green"), ("host-tier hit", "tab:olive"), ("miss", "tab:gray"))
    ):
        values = np.asarray([s[i] for s in shares])
        bars = tiers.bar(names, values, bottom=bottom, color=color, label=label)
        tiers.bar_label(bars, [f"{v:.0%}" if v >= 0.05 else "" for v in values], label_type="center", fontsize=7)
        bottom += values
    tiers.set_ylim(0, 1)
    tiers.set_ylabel("share of cache lookups")
    tiers.set_title("lookups by serving tier", fontsize=9)
    tiers.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=1, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
