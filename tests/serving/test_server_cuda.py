"""The ranking server on a CUDA device: same load as the CPU eviction test, scores vs the CPU model."""

from __future__ import annotations

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from .conftest import eviction_workload, matches_reference, post_per_user_in_order, serving

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# fp32 on the GPU: the paged attention kernel may use TF32 dot products, hence a looser tolerance.
CUDA_RTOL = 2e-3


@pytest.mark.anyio
async def test_cuda_server_with_eviction_matches_the_cpu_no_cache_model(reference):
    settings, payloads = eviction_workload(first_user=500, device="cuda")
    async with serving(settings) as (app, client):
        responses = await post_per_user_in_order(client, payloads, concurrency=20)
        # read from /metrics: on CUDA the default server runs its engine (and cache) in a child process
        text = (await client.get("/metrics")).text
    bodies = [r.json() for r in responses]
    assert [r.status_code for r in responses] == [200] * len(payloads), [b for b in bodies if "error" in b][:3]
    mismatches = [
        i
        for i, (p, b) in enumerate(zip(payloads, bodies))
        if not matches_reference(reference, p, b, CUDA_RTOL)
    ]
    assert mismatches == []
    assert sample_sum(text, "hstu_cache_evictions_total", tier="gpu") > 0
    assert sample_sum(text, "hstu_cache_lookups_total", result="host_hit") > 0
    assert sample_sum(text, "hstu_cache_bytes_total", direction="onload") > 0


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a /metrics series over the labels not given (the engine process adds `replica`)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )
