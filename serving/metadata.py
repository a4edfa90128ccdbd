"""The served model's metadata (GET /v2/models/hstu, after the Open Inference Protocol's model metadata).

Besides the protocol's name / versions / platform it carries what a client needs to reproduce the
server's scores: the HSTUConfig, the request limits, the task names, dtype, device, cache sizes and
the weights fingerprint (hstu.model.identity.model_identity over the config and every weight, hex;
null until the model is loaded). `hstu replay --server URL --verify` compares that fingerprint
with its own no-cache model's before it checks any score.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, Field

from hstu import __version__
from hstu.serving.runtime import Runtime

MODEL_NAME = "hstu"


class CacheSizes(BaseModel):
    """The ServerSettings fields of the same names."""

    page_size: int
    num_pages: int
    chunk_tokens: int
    host_cache_bytes: int
    host_format: str = Field(description="what a host chunk holds: 'kv' (K/V pages) or 'hidden' (layer inputs)")


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    package_version: str
    config: dict[str, Any] = Field(description="HSTUConfig.to_dict() of the served model")
    limits: dict[str, int] = Field(description="RequestLimits: the bounds every request must satisfy")
    task_names: list[str]
    dtype: str
    device: str
    cache: CacheSizes
    weights_fingerprint: str | None = Field(description="model_identity(model, config) in hex; null until loaded")
    replicas: int = Field(description="ranking replicas serving the model (1 for `hstu serve`, N on Ray Serve)")
    ready: bool


class ModelReady(BaseModel):
    name: str
    ready: bool


def model_metadata(runtime: Runtime, task_names: tuple[str, ...]) -> ModelMetadata:
    """The metadata document of `runtime`'s model as it is now."""
    s, cfg = runtime.settings, runtime.config
    return ModelMetadata(
        name=MODEL_NAME,
        versions=[__version__],
        platform="pytorch",
        package_version=__version__,
        config=cfg.to_dict(),
        limits=dataclasses.asdict(runtime.limits),
        task_names=list(task_names),
        dtype=cfg.dtype,
        device=s.device,
        cache=CacheSizes(**{name: getattr(s, name) for name in CacheSizes.model_fields}),
        weights_fingerprint=runtime.fingerprint,
        replicas=runtime.replicas,
        ready=runtime.ready,
    )
