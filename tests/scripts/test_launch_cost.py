"""scripts/launch_cost.py: the model thread's launch cost of a graph batch, piece by piece."""

from __future__ import annotations

import sys

import pytest
import torch

from hstu.scripts import launch_cost
from hstu.scripts.bench_shapes import TINY_SHAPE


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_without_cuda_it_says_it_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["launch_cost"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        launch_cost.main()


def test_the_pieces_of_a_cached_batch_are_timed_uncaptured_on_a_cpu():
    costs, top = launch_cost.launch_costs(2, iters=3, shape=TINY_SHAPE, device="cpu")
    for piece in ("run", "host stage + replay", "host replay", "logits clone", "plan"):
        assert costs[piece] > 0, piece
    assert "device launch" not in costs
    assert top and all(row["own_us"] >= 0 for row in top)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_piece_is_timed_on_a_small_shape():
    costs, _ = launch_cost.launch_costs(2, iters=5, shape=TINY_SHAPE)
    for piece in ("run", "host stage + replay", "host replay", "event record", "logits clone", "current stream",
                  "device launch", "plan"):
        assert costs[piece] > 0, piece
