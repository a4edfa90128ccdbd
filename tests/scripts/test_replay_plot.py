"""replay.png: one point per request on a log latency axis, an explained trend, labels true to the mode."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from hstu.scripts import replay_plot  # noqa: E402
from hstu.scripts.replay_passes import PassResult, RequestRecord  # noqa: E402


def _pass(name: str, client_observed: bool = False) -> PassResult:
    # 3 batches of 2 requests; one slow outlier that a linear axis would flatten the rest under.
    latencies = [10.0, 10.0, 12.0, 12.0, 5000.0, 5000.0]
    records = [RequestRecord(u, 100 * (u + 1), 8, 0, u // 2, 2, ms) for u, ms in enumerate(latencies)]
    stats = {"gpu_hits": 3, "host_hits": 1, "misses": 2}
    return PassResult(name, records, 1.0, stats, client_observed=client_observed)


@pytest.fixture
def figure(tmp_path, monkeypatch):
    """Draw the plot and hand back its (latency axes, tier axes), the file written and the legend texts."""
    drawn = {}
    monkeypatch.setattr(plt, "close", lambda fig: drawn.setdefault("fig", fig))

    def draw(results, device="cpu"):
        path = tmp_path / "replay.png"
        replay_plot.plot_latency(results, path, "title", device)
        latency, tiers = drawn.pop("fig").axes
        legend = [t.get_text() for t in latency.get_legend().get_texts()]
        tier_legend = [t.get_text() for t in tiers.get_legend().get_texts()]
        return latency, tiers, path, legend, tier_legend

    return draw


def test_the_plot_has_one_point_per_request_on_a_log_latency_axis(figure):
    latency, _, path, legend, _ = figure([_pass("cached"), _pass("uncached")])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert latency.get_yscale() == "log"
    points = [c.get_offsets() for c in latency.collections]
    assert [len(p) for p in points] == [6, 6], "one point per request, not per batch"
    assert np.asarray(points[0])[:, 0].tolist() == [100, 200, 300, 400, 500, 600]
    assert latency.get_xlabel() == "history length of the request (tokens)"
    assert "cached: median per history bin (8 bins)" in legend
    assert any(t.startswith("uncached: 6 requests") for t in legend)


def test_in_process_latency_says_it_is_the_batch_time(figure):
    latency = figure([_pass("cached")])[0]
    assert "time of its batch" in latency.get_ylabel() and "log scale" in latency.get_ylabel()


def test_server_latency_says_it_is_client_observed(figure):
    latency = figure([_pass("server", client_observed=True)], device="cuda:0")[0]
    assert latency.get_ylabel().startswith("client-observed request latency")


def test_the_tier_panel_names_the_device_tier_after_its_device(figure):
    _, tiers, _, _, tier_legend = figure([_pass("cached")])
    assert tier_legend == ["device-tier (cpu) hit", "host-tier hit", "miss"]
    heights = [p.get_height() for p in tiers.patches]
    assert heights == pytest.approx([0.5, 1 / 6, 1 / 3])
    assert not any("GPU" in t for t in tier_legend)


def test_binned_medians_leave_empty_bins_out():
    x = np.asarray([0.0, 1.0, 2.0, 100.0])
    y = np.asarray([1.0, 3.0, 5.0, 7.0])
    mids, meds = replay_plot.binned_medians(x, y, bins=4)
    assert meds.tolist() == [3.0, 7.0]
    assert len(mids) == 2 and mids[0] < mids[1]
    assert replay_plot.binned_medians(np.empty(0), np.empty(0))[0].size == 0
