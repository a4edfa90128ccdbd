"""The tiny model configs the tests run, pinned in one place so a test's model is named, not
re-typed: changing a size here changes it for every test that shares it."""

from __future__ import annotations

import dataclasses

from hstu.model.config import HSTUConfig

# The default test model (the `tiny_config` fixture): small enough for CPU, two layers so the
# cache crosses a layer boundary.
TINY = HSTUConfig(
    num_items=500, num_actions=4, num_contextual=2, num_contextual_features=50, embedding_dim=32,
    num_layers=2, num_heads=2, head_dim_qk=16, head_dim_v=16, max_seq_len=256, mlp_hidden=32,
)

# The served model of the serving tests: more items, fewer time buckets, three named tasks, its own seed.
SERVING_TINY = HSTUConfig(
    num_items=1000, num_actions=4, num_contextual=2, num_contextual_features=50, embedding_dim=32,
    num_layers=2, num_heads=2, head_dim_qk=16, head_dim_v=16, max_seq_len=256, num_time_buckets=16,
    num_tasks=3, mlp_hidden=32, seed=3,
)

# The model the replay script tests drive (default actions, 100 contextual features).
REPLAY_MODEL = HSTUConfig(
    num_items=500, num_contextual_features=100, embedding_dim=32, num_layers=2, num_heads=2,
    head_dim_qk=16, head_dim_v=16, max_seq_len=256, mlp_hidden=32,
)

# The workload generator tests' model: one layer, room for 512-token histories.
WORKLOAD_MODEL = dataclasses.replace(REPLAY_MODEL, num_layers=1, max_seq_len=512)


def cuda_pipeline_model(dtype: str) -> HSTUConfig:
    """The GPU pipeline tests' model: real head sizes (64), 3 layers, 1024 tokens, in `dtype`."""
    return HSTUConfig(
        num_items=5_000, num_contextual_features=100, embedding_dim=128, num_layers=3, num_heads=2,
        head_dim_qk=64, head_dim_v=64, max_seq_len=1024, mlp_hidden=64, dtype=dtype,
    )
