"""ServerSettings: everything `hstu serve` can set, resolved into the model and cache configs.

One source of configuration: ServerSettings.load() merges a config file (--config-file), HSTU_*
environment variables and the command-line flags, in that order, onto these fields, with the model
config as the nested "model" section (serving/config_sources.py); unknown keys are an error.

Construction rejects values that are wrong on their own (a zero size, an unknown device);
check() rejects a configuration that cannot work on this machine (missing files, an unreadable
or unknown-keyed model config, CUDA asked for but absent, cache sizes that do not fit together)
so `hstu serve` can exit with one line before it binds the port.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from hstu.model.config import HSTUConfig
from hstu.serving.config_sources import MODEL_SECTION, check_keys, merge, read_env, read_file

if TYPE_CHECKING:
    from hstu.ops.kvcache.config import KVCacheConfig


_CUDA_PARSE_PROCESSES = 4  # parse workers of a CUDA server by default

_POSITIVE = (
    "gil_switch_interval_ms",
    "page_size",
    "num_pages",
    "chunk_tokens",
    "max_batch_size",
    "max_queue",
    "max_candidates",
    "max_queue_wait_ms",
    "request_timeout_ms",
    "max_body_bytes",
    "shutdown_timeout_s",
)


@dataclass(frozen=True)
class ServerSettings:
    """Server, batcher and cache sizes; the model comes from `model_config` or `model_config_path`.

    `model_config` (an HSTUConfig object) wins over `model_config_path` (an HSTUConfig JSON file);
    with neither, the embedded HSTUConfig defaults are served. `dtype` overrides the config's dtype.
    An unchanged history is re-ranked from the cache alone (on_no_new_tokens="candidates": only the
    candidates are computed). A history shorter than the cached one that is exactly its first
    tokens (a user's older request arriving after a newer one: retries, several connections, parse
    workers finishing out of order) is ranked from the cached prefix read-only and the longer entry
    kept (on_shorter_history="reuse", the default); any other shorter history is treated as a new
    history and recomputed, so a client can never lock a user out. "invalidate" recomputes every
    shorter history; the opt-in strict mode "raise" answers HTTP 409.
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
    max_queue_wait_ms: float = 2_000.0  # longest wait in the queue, then 503 overloaded
    request_timeout_ms: float = 10_000.0  # deadline from arrival, then 504
    max_body_bytes: int | None = None  # None: sized for the longest valid request (RequestLimits)
    shutdown_timeout_s: float = 10.0  # time queued requests get on shutdown, then 503
    max_candidates: int = 1024
    task_names: tuple[str, ...] | None = None
    cuda_graphs: bool = False
    compile_layers: bool = False
    on_shorter_history: str = "reuse"
    # Split host-tier prefixes between onload and recompute, with costs measured at start-up
    # through the engine's own forward. None: on for CUDA devices, where it was measured (H200,
    # benchmarks/RESULTS.md, tenth session: a host-tier batch of 8 at 1.21x of no cache against
    # 0.93x for pure onload; the ninth session's block-only fit lost, 0.77-0.99x); off on CPU,
    # where the host tier is a memory copy and the start-up measurement would only cost time.
    planner: bool | None = None
    h2d_gb_per_s: float | None = None  # overrides the measured host->device bandwidth
    planner_min_gain: float | None = None  # overrides the share an onload must save over recomputing, a split over pure onload (CostModel.min_gain)
    # overrides the share a split's compute is priced higher when splits are ranked (CostModel.compute_margin)
    planner_compute_margin: float | None = None
    offload_min_seen: int = 2  # offload a user's chunks once it was seen this often
    offload_mb_per_s: float | None = None  # D2H pacing budget (None: unlimited)
    # The engine in a child process (serving/engine_process.py), and worker processes parsing large
    # bodies off the GIL (0: a thread of this process). None: on for CUDA devices (the engine
    # process and 4 parse workers), off on CPU; on the H200 they ran the seed workload 1.1-1.5x and
    # 1.1-1.45x faster over REST (benchmarks/RESULTS.md, seventh and tenth sessions).
    engine_process: bool | None = None
    parse_processes: int | None = None
    # HTTP front-end processes sharing the port, each forwarding to the one engine process
    # (serving/front_ends.py), for a server whose front-end event loop is the limit. 1 by default
    # (the eleventh session's H200 ran 2-3 at 0.65-0.88x, its engine then on a model thread); with
    # the engine launching on its loop, the GPU runs measure 2 and 4 (RESULTS.md, runs CD-CI: four
    # answered a paced load at 0.58x of two's p50, same call), not yet 1 against them.
    front_ends: int = 1
    history_store_bytes: int = 256 << 20  # histories kept for incremental requests (0: none, every request sends all)
    # The GIL's switch interval of the process running the engine (sys.setswitchinterval; None:
    # Python's 5 ms). Every torch call on the model thread drops the GIL; taking it back waits up to
    # this long while another thread (request unpickling, output pickling, the batcher's loop, the
    # offload worker) runs Python. An experiment knob: 0.5 ms ran the sent load 1.15x faster in one
    # H200 call and 0.76x in another (RESULTS.md, thirteenth session), within the runs' spread.
    gil_switch_interval_ms: float | None = None
    # KVCacheConfig.prepare_worker: each batch's prepare job on a worker thread (an experiment knob)
    prepare_worker: bool = False
    # The engine process launches each batch on its event loop's thread instead of a model thread
    # of its own (Batcher inline; None: on whenever engine_process is). Why: on the H200, with two
    # front ends feeding it, the engine process's model thread took 3.75-4.85 ms a batch against
    # 1.75 ms in process (RESULTS.md, run BE): its loop, pipe readers and senders took the GIL from
    # it between torch calls. On the loop's thread the launch and the loop's own work no longer pass
    # the GIL to each other, and the loop reads the pipes itself (no reader threads): 1,217
    # requests/s against 733-762 with a model thread, same call (run CD). Needs engine_process (in
    # one process it would stall HTTP during every launch).
    model_on_loop: bool | None = None
    # KVCacheConfig.host_split: which end of a host-tier prefix the planner onloads (auto: either, per batch)
    host_split: str = "auto"
    # KVCacheConfig.host_format: host chunks as K/V pages or, computed whole, as layer inputs (hidden)
    host_format: str = "kv"

    def __post_init__(self) -> None:
        cuda = self.device.startswith("cuda")
        if self.planner is None:
            object.__setattr__(self, "planner", cuda)
        if self.engine_process is None:
            object.__setattr__(self, "engine_process", cuda)
        if self.model_on_loop is None:
            object.__setattr__(self, "model_on_loop", bool(self.engine_process))
        if self.parse_processes is None:
            object.__setattr__(self, "parse_processes", _CUDA_PARSE_PROCESSES if cuda else 0)
        if self.front_ends < 1:
            raise ValueError(f"front_ends must be >= 1, got {self.front_ends}")
        if self.host_split not in ("load_front", "compute_front", "auto"):  # KVCacheConfig's check, before torch loads
            raise ValueError(f"host_split must be one of load_front, compute_front, auto, got {self.host_split!r}")
        if self.host_format not in ("kv", "hidden"):  # KVCacheConfig's check, before torch loads
            raise ValueError(f"host_format must be 'kv' or 'hidden', got {self.host_format!r}")
        if self.front_ends > 1 and not self.engine_process:
            raise ValueError(f"front_ends {self.front_ends} share one engine process: it needs engine_process")
        if self.model_on_loop and not self.engine_process:
            raise ValueError("model_on_loop runs batches on the engine process's event loop: it needs engine_process "
                             "(in one process every launch would stall HTTP)")
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and not value > 0:  # `not > 0` also refuses NaN
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        for name in ("host_cache_bytes", "history_store_bytes", "parse_processes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device, got device {self.device!r}")
        if self.compile_layers and not self.cuda_graphs:
            raise ValueError("compile_layers compiles the layers the CUDA graphs capture: it needs cuda_graphs")

    @classmethod
    def load(
        cls, config_file: str | None = None, env: Mapping[str, str] | None = None, **flags: Any
    ) -> "ServerSettings":
        """Settings from `config_file`, then HSTU_* variables of `env` (os.environ when None; {}
        for none), then `flags` (field name -> value, None = not given): later sources win."""
        docs = []
        if config_file is not None:
            doc = read_file(config_file)
            check_keys(doc, cls, HSTUConfig, f"config file {config_file!r}", _NOT_SOURCED)
            docs.append(doc)
        docs.append(read_env(os.environ if env is None else env, cls, HSTUConfig, _NOT_SOURCED))
        given = {k: v for k, v in flags.items() if v is not None}
        check_keys(given, cls, HSTUConfig, "flags", ())
        values = merge(*docs, given)
        model = values.pop(MODEL_SECTION, None)
        if isinstance(values.get("task_names"), list):
            values["task_names"] = tuple(values["task_names"])
        settings = cls(**values)
        if model:
            base = settings.resolve_model_config()
            try:
                settings = dataclasses.replace(settings, model_config=dataclasses.replace(base, **model))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"model settings {model}: {exc}") from exc
        return settings

    def resolve_model_config(self) -> HSTUConfig:
        """The served HSTUConfig, with the dtype override applied."""
        if self.model_config is not None:
            cfg = self.model_config
        elif self.model_config_path is not None:
            cfg = load_model_config(self.model_config_path)
        else:
            cfg = HSTUConfig()
        if self.dtype is not None and self.dtype != cfg.dtype:
            cfg = dataclasses.replace(cfg, dtype=self.dtype)
        return cfg

    def resolve_task_names(self, cfg: HSTUConfig) -> tuple[str, ...]:
        """The configured task names checked against the model's heads (HSTUConfig.resolve_task_names)."""
        return cfg.resolve_task_names(self.task_names)

    def check(self) -> None:
        """Raise ValueError naming the problem if this configuration cannot serve on this machine."""
        from hstu.serving.schemas import RequestLimits

        cfg = self.resolve_model_config()
        self.resolve_task_names(cfg)
        self.kv_config(cfg)
        RequestLimits.for_model(cfg, self.max_candidates, self.max_body_bytes)
        if self.checkpoint is not None and not Path(self.checkpoint).is_file():
            raise ValueError(f"checkpoint {self.checkpoint!r} is not a file")
        if self.device.startswith("cuda"):
            check_cuda_device(self.device)

    def kv_config(self, cfg: HSTUConfig) -> "KVCacheConfig":
        from hstu.ops.kvcache.config import KVCacheConfig

        return KVCacheConfig.for_model(
            cfg,
            page_size=self.page_size,
            num_pages=self.num_pages,
            chunk_tokens=self.chunk_tokens,
            host_capacity_bytes=self.host_cache_bytes,
            on_no_new_tokens="candidates",
            on_shorter_history=self.on_shorter_history,
            offload_min_seen=self.offload_min_seen,
            offload_bytes_per_s=None if self.offload_mb_per_s is None else self.offload_mb_per_s * 2**20,
            prepare_worker=self.prepare_worker,
            host_split=self.host_split,
            host_format=self.host_format,
        )


# Fields that hold objects: set in code or through the "model" section, never as plain values.
_NOT_SOURCED = ("model_config",)


def load_model_config(path: str) -> HSTUConfig:
    """An HSTUConfig from a JSON file; ValueError naming the file for an unreadable, non-object or
    unknown-keyed document (a typo must not silently fall back to a default)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"model config {path!r} cannot be read as JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"model config {path!r} must be a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - {f.name for f in dataclasses.fields(HSTUConfig)})
    if unknown:
        raise ValueError(f"model config {path!r} has unknown keys {unknown}")
    try:
        return HSTUConfig(**doc)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"model config {path!r}: {exc}") from exc


def check_cuda_device(device: str) -> None:
    """ValueError unless `device` (cuda or cuda:N) exists on this machine."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available (torch.cuda.is_available() is False)")
    try:
        index = torch.device(device).index
    except RuntimeError as exc:
        raise ValueError(f"device {device!r} is not a valid device: {exc}") from exc
    if index is not None and index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} requested but only {torch.cuda.device_count()} CUDA devices exist")
