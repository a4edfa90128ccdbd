"""HSTULayer.project_kv: the keys and values rebuilt from a layer's input (the host tier's
hidden-state chunks) equal those of the layer's full projection."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hstu.model.hstu_block import HSTUBlock
from hstu.model.hstu_layer import HSTULayer
from tests.configs import TINY


@pytest.mark.parametrize("variant", ["nvidia", "meta_stu"])
def test_project_kv_equals_the_projections_keys_and_values(variant):
    torch.manual_seed(0)
    block = HSTUBlock(dataclasses.replace(TINY, layer_variant=variant))
    for layer in block.layers:
        torch.nn.init.normal_(layer.uvqk.bias)  # a bias of zeros would hide a slicing error
    x = torch.randn(9, TINY.embedding_dim)
    for index, layer in enumerate(block.layers):
        _, _, k, v = layer.project(x)
        k2, v2 = block.kv_from_hidden(index, x)
        assert k2.shape == k.shape and v2.shape == v.shape
        torch.testing.assert_close(k2, k, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v2, v, rtol=1e-5, atol=1e-6)


def test_project_kv_follows_new_weights():
    """load_state_dict copies into the parameters in place: project_kv reads views of them (the
    rebuild graphs capture those views), so it follows."""
    torch.manual_seed(1)
    block = HSTUBlock(TINY)
    x = torch.randn(4, TINY.embedding_dim)
    block.kv_from_hidden(0, x)
    other = HSTUBlock(TINY)
    block.load_state_dict(other.state_dict())
    _, _, k, v = other.layers[0].project(x)
    k2, v2 = block.kv_from_hidden(0, x)
    torch.testing.assert_close(k2, k, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v2, v, rtol=1e-5, atol=1e-6)


def test_forward_paged_hands_out_each_layers_input():
    """layer_inputs receives layer i's input, so project_kv of it gives the K/V layer i appended."""
    block = HSTUBlock(TINY)
    seen = []

    def layer_fn(index):
        def fn(x, kv_cache, meta):
            seen.append(x)
            return x * 2 + index

        return fn

    inputs: list[torch.Tensor] = []
    x = torch.randn(5, TINY.embedding_dim)
    out = block.forward_paged(x, None, None, layer_fns=[layer_fn(i) for i in range(TINY.num_layers)], layer_inputs=inputs)
    assert len(inputs) == TINY.num_layers and all(a is b for a, b in zip(inputs, seen))
    assert torch.equal(out, (x * 2) * 2 + 1)


def test_forward_paged_waits_for_a_layers_onload_after_its_projection():
    """before_layer(i) (layer i's onload wait) comes after layer i's input projection, which reads
    no cached K/V, and before its cache reads; with compiled layer functions, before the layer."""
    block = HSTUBlock(TINY)
    events = []
    for i, layer in enumerate(block.layers):
        projection = layer.projection
        layer.projection = lambda x, out=None, i=i, projection=projection: events.append(("project", i)) or projection(x, out)
    block.paged_attend = lambda i, x, uvqk, kv, meta: events.append(("attend", i)) or x + i
    x = torch.randn(3, TINY.embedding_dim)
    block.forward_paged(x, None, None, before_layer=lambda i: events.append(("wait", i)))
    L = TINY.num_layers
    assert events == [e for i in range(L) for e in (("project", i), ("wait", i), ("attend", i))]
    events.clear()
    fns = [lambda x, kv, meta, i=i: events.append(("layer", i)) or x for i in range(L)]
    block.forward_paged(x, None, None, before_layer=lambda i: events.append(("wait", i)), layer_fns=fns)
    assert events == [e for i in range(L) for e in (("wait", i), ("layer", i))]


@pytest.mark.parametrize("variant", ["nvidia", "meta_stu"])
def test_a_projection_written_into_a_buffer_equals_the_allocated_one(variant):
    """The graph segments' projection into a shared buffer is the layer's projection, bit for bit."""
    layer = HSTULayer(dataclasses.replace(TINY, layer_variant=variant))
    x = torch.randn(6, TINY.embedding_dim)
    buffer = torch.full((8, layer.uvqk.out_features), float("nan"))
    with torch.no_grad():  # (as the engine runs it: out= takes no autograd)
        out = layer.projection(x, out=buffer[:6])
    assert out.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(out, layer.projection(x), rtol=0, atol=0)
    for a, b in zip(layer.split_projection(out), layer.project(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
