"""ServerSettings: everything `hstu serve` can set, resolved into the model and cache configs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hstu.model.config import HSTUConfig
from hstu.ops.kvcache.config import KVCacheConfig


@dataclass(frozen=True)
class ServerSettings:
    """Server, batcher and cache sizes; the model comes from `model_config` or `model_config_path`.

    `model_config` (an HSTUConfig object) wins over `model_config_path` (an HSTUConfig JSON file);
    with neither, the embedded HSTUConfig defaults are served. `dtype` overrides the config's dtype.
    An unchanged history is re-ranked from the cache alone (on_no_new_tokens="candidates": only the
    candidates are computed); a history
    shorter than the cached one is treated as a new history and recomputed (on_shorter_history=
    "invalidate", the default: a client can never lock a user out), or rejected with HTTP 409 in the
    opt-in strict mode on_shorter_history="raise".
    """

    model_config: HSTUConfig | None = None
    model_config_path: str | None = None
    checkpoint: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    page_size: int = 32
    num_pages: int = 1024
    chunk_tokens: int = 128
    host_cache_bytes: int = 1 << 30
    max_batch_size: int = 16
    max_wait_ms: float = 2.0
    max_queue: int = 4096
    max_candidates: int = 1024
    task_names: tuple[str, ...] | None = None
    cuda_graphs: bool = False
    compile_layers: bool = False
    on_shorter_history: str = "invalidate"

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "chunk_tokens", "max_batch_size", "max_queue", "max_candidates"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0, got {self.host_cache_bytes}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device, got device {self.device!r}")
        if self.compile_layers and not self.cuda_graphs:
            raise ValueError("compile_layers compiles the layers the CUDA graphs capture: it needs cuda_graphs")

    def resolve_model_config(self) -> HSTUConfig:
        """The served HSTUConfig, with the dtype override applied."""
        if self.model_config is not None:
            cfg = self.model_config
        elif self.model_config_path is not None:
            cfg = HSTUConfig.from_json(self.model_config_path)
        else:
            cfg = HSTUConfig()
        if self.dtype is not None and self.dtype != cfg.dtype:
            cfg = dataclasses.replace(cfg, dtype=self.dtype)
        return cfg

    def resolve_task_names(self, cfg: HSTUConfig) -> tuple[str, ...]:
        """One unique name per task head: the configured names, else task_0 .. task_{T-1}."""
        if self.task_names is None:
            return tuple(f"task_{i}" for i in range(cfg.num_tasks))
        if len(self.task_names) != cfg.num_tasks or len(set(self.task_names)) != cfg.num_tasks:
            raise ValueError(f"need {cfg.num_tasks} distinct task names, got {list(self.task_names)}")
        return self.task_names

    def kv_config(self, cfg: HSTUConfig) -> KVCacheConfig:
        return KVCacheConfig.for_model(
            cfg,
            page_size=self.page_size,
            num_pages=self.num_pages,
            chunk_tokens=self.chunk_tokens,
            host_capacity_bytes=self.host_cache_bytes,
            on_no_new_tokens="candidates",
            on_shorter_history=self.on_shorter_history,
        )
