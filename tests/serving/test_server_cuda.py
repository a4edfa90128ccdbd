"""The ranking server on a CUDA device: same load as the CPU eviction test, scores vs the CPU model."""

from __future__ import annotations

import pytest
import torch

from hstu.scripts.replay_server import parse_server_metrics

from .conftest import eviction_workload, matches_reference, post_per_user_in_order, serving

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# fp32 on the GPU: the paged attention kernel may use TF32 dot products, hence a looser tolerance.
CUDA_RTOL = 2e-3


@pytest.mark.anyio
@pytest.mark.parametrize("host_format", ["kv", "hidden"])
async def test_cuda_server_with_eviction_matches_the_cpu_no_cache_model(reference, host_format):
    # planner off: every host hit onloads. With it (the CUDA default) the tiny model's recompute is
    # cheaper than any onload, so the hidden format's host hits were all recomputed (run HA): this
    # test is about the onload path under eviction; the planner's choices have tests of their own.
    settings, payloads = eviction_workload(first_user=500, device="cuda", host_format=host_format, planner=False)
    async with serving(settings) as (app, client):
        responses = await post_per_user_in_order(client, payloads, concurrency=20)
        # read from /metrics: on CUDA the default server runs its engine (and cache) in a child process
        stats = parse_server_metrics((await client.get("/metrics")).text)
    bodies = [r.json() for r in responses]
    assert [r.status_code for r in responses] == [200] * len(payloads), [b for b in bodies if "error" in b][:3]
    mismatches = [
        i
        for i, (p, b) in enumerate(zip(payloads, bodies))
        if not matches_reference(reference, p, b, CUDA_RTOL)
    ]
    assert mismatches == []
    assert stats["gpu_evictions"] > 0 and stats["host_hits"] > 0 and stats["bytes_onloaded"] > 0, stats
