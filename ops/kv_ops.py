"""Python face of the hstu KV ops: thin wrappers, fake (meta) impls, pure-torch references.

Every op is a torch.library custom op defined in csrc/ops.cpp (CPU) and csrc/kernels/*.cu (CUDA);
the fakes below let torch.compile trace them. The references are the readable definition each
kernel is tested against.

Layouts: kv_cache [L, P, 2, page_size, H, d] (K at index 0, V at 1); host_arena
[S, L, pages_per_chunk, 2, page_size, H, d]; hidden_arena [S, L, chunk_tokens, D] (the host tier's
hidden-state chunks: a view of the host arena's slots, each slot's block contiguous); k/v [T, H, d];
index tensors int32.
"""

from __future__ import annotations

import torch

from hstu.ops._build import load_extension

load_extension()
_ops = torch.ops.hstu


@torch.library.register_fake("hstu::append_kvcache")
def _append_fake(kv_cache, k, v, page_ids, page_offsets, layer, rows=None, skip_page=-1) -> None:
    return None


@torch.library.register_fake("hstu::gather_kvcache")
def _gather_fake(kv_cache, layer, page_indices, page_indptr, last_page_len):
    n = torch.library.get_ctx().new_dynamic_size()
    shape = (n, kv_cache.shape[4], kv_cache.shape[5])
    return kv_cache.new_empty(shape), kv_cache.new_empty(shape)


@torch.library.register_fake("hstu::gather_kvcache_all_layers")
def _gather_all_fake(kv_cache, page_ids):
    L, _, two, ps, H, d = kv_cache.shape
    return kv_cache.new_empty((page_ids.shape[0], L, page_ids.shape[1], two, ps, H, d))


@torch.library.register_fake("hstu::onload_kvcache")
def _onload_fake(kv_cache, host_arena, slot_ids, page_ids, layer) -> None:
    return None


@torch.library.register_fake("hstu::store_host_chunks")
def _store_fake(host_arena, chunks, slot_ids) -> None:
    return None


@torch.library.register_fake("hstu::onload_hidden")
def _onload_hidden_fake(out, hidden_arena, slot_ids, layer) -> None:
    return None


@torch.library.register_fake("hstu::store_hidden_chunks")
def _store_hidden_fake(hidden_arena, chunks, slot_ids) -> None:
    return None


@torch.library.register_fake("hstu::write_pinned")
def _write_pinned_fake(dst, src) -> None:
    return None


@torch.library.register_fake("hstu::read_pinned")
def _read_pinned_fake(dst, src) -> None:
    return None


def append_kvcache(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page_ids: torch.Tensor,
    page_offsets: torch.Tensor,
    layer: int,
    rows: torch.Tensor | None = None,
    skip_page: int = -1,
) -> None:
    """Write new tokens' K/V of `layer` into slots (page_ids[t], page_offsets[t]) in place.

    Token t's K/V are k[t], v[t] ([T, H, d]), or with `rows` (int64 [n]) rows rows[t] of a larger
    k, v (a layer's whole projection: no gathered copy). Tokens bound for page `skip_page` (>= 0: a
    CUDA graph bucket's scratch page, where its padded appends would go) are not written."""
    _ops.append_kvcache(kv_cache, k, v, page_ids, page_offsets, layer, rows, skip_page)


def gather_kvcache(
    kv_cache: torch.Tensor, layer: int, page_indices: torch.Tensor, page_indptr: torch.Tensor, last_page_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages of each user (CSR page_indices/page_indptr, last_page_len) -> jagged K, V [sum_len, H, d]."""
    return _ops.gather_kvcache(kv_cache, layer, page_indices, page_indptr, last_page_len)


def gather_kvcache_all_layers(kv_cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Whole pages of every layer, chunk-major: page_ids [n, ppc] -> [n, L, ppc, 2, page_size, H, d]."""
    return _ops.gather_kvcache_all_layers(kv_cache, page_ids)


def onload_kvcache(
    kv_cache: torch.Tensor, host_arena: torch.Tensor, slot_ids: torch.Tensor, page_ids: torch.Tensor, layer: int
) -> None:
    """Host chunk slots -> pages of `layer`: kv_cache[layer, page_ids[c, p]] = host_arena[slot_ids[c], layer, p]."""
    _ops.onload_kvcache(kv_cache, host_arena, slot_ids, page_ids, layer)


def store_host_chunks(host_arena: torch.Tensor, chunks: torch.Tensor, slot_ids: torch.Tensor) -> None:
    """Gathered chunks [n, L, ppc, 2, page_size, H, d] -> host_arena[slot_ids[c]] (D2H on CUDA)."""
    _ops.store_host_chunks(host_arena, chunks, slot_ids)


def onload_hidden(out: torch.Tensor, hidden_arena: torch.Tensor, slot_ids: torch.Tensor, layer: int) -> None:
    """Layer `layer` of hidden-state slots -> out [n, chunk_tokens, D]: out[c] = hidden_arena[slot_ids[c], layer]
    (H2D on CUDA: one copy per slot, no kernel)."""
    _ops.onload_hidden(out, hidden_arena, slot_ids, layer)


def store_hidden_chunks(hidden_arena: torch.Tensor, chunks: torch.Tensor, slot_ids: torch.Tensor) -> None:
    """Hidden-state chunks [n, L, chunk_tokens, D] -> hidden_arena[slot_ids[c]] (D2H on CUDA)."""
    _ops.store_hidden_chunks(hidden_arena, chunks, slot_ids)


def write_pinned(dst: torch.Tensor, src: torch.Tensor) -> None:
    """src -> dst, same dtype and size, both contiguous. On CUDA, src on the GPU and dst pinned host
    memory written by a kernel through its mapped address, ordered on the current stream: no copy
    engine, so a small result (a batch's logits) never waits behind a bulk D2H (an offload) that
    another stream queued on the engine first."""
    _ops.write_pinned(dst, src)


def read_pinned(dst: torch.Tensor, src: torch.Tensor) -> None:
    """src -> dst, same dtype and size, both contiguous. On CUDA, dst on the GPU and src pinned host
    memory read by a kernel through its mapped address, ordered on the current stream: no copy
    engine, so a CUDA-graph batch's staged inputs never wait behind its onload's copies, which
    may then be enqueued first (engine/graphs.py, ForwardGraphs.stage)."""
    _ops.read_pinned(dst, src)


def append_kvcache_reference(kv_cache, k, v, page_ids, page_offsets, layer, rows=None, skip_page=-1) -> None:
    """Readable definition of append_kvcache, one token at a time."""
    for t in range(page_ids.shape[0]):
        page, off = int(page_ids[t]), int(page_offsets[t])
        if page == skip_page:
            continue
        row = int(rows[t]) if rows is not None else t
        kv_cache[layer, page, 0, off] = k[row]
        kv_cache[layer, page, 1, off] = v[row]


def gather_kvcache_reference(kv_cache, layer, page_indices, page_indptr, last_page_len):
    """Readable definition of gather_kvcache: concatenate each user's tokens page by page."""
    ks, vs = [], []
    page_size = kv_cache.shape[3]
    for b in range(last_page_len.shape[0]):
        pages = page_indices[int(page_indptr[b]) : int(page_indptr[b + 1])].tolist()
        for i, page in enumerate(pages):
            n = int(last_page_len[b]) if i == len(pages) - 1 else page_size
            ks.append(kv_cache[layer, page, 0, :n])
            vs.append(kv_cache[layer, page, 1, :n])
    empty = kv_cache.new_empty((0, kv_cache.shape[4], kv_cache.shape[5]))
    return (torch.cat(ks) if ks else empty), (torch.cat(vs) if vs else empty)


def gather_kvcache_all_layers_reference(kv_cache, page_ids):
    """Readable definition of gather_kvcache_all_layers."""
    return torch.stack([kv_cache[:, page_ids[c].long()] for c in range(page_ids.shape[0])])


def onload_kvcache_reference(kv_cache, host_arena, slot_ids, page_ids, layer) -> None:
    """Readable definition of onload_kvcache."""
    for c in range(slot_ids.shape[0]):
        for p in range(page_ids.shape[1]):
            kv_cache[layer, int(page_ids[c, p])] = host_arena[int(slot_ids[c]), layer, p].to(kv_cache.device)


def onload_hidden_reference(out, hidden_arena, slot_ids, layer) -> None:
    """Readable definition of onload_hidden."""
    for c in range(slot_ids.shape[0]):
        out[c] = hidden_arena[int(slot_ids[c]), layer].to(out.device)


def store_hidden_chunks_reference(hidden_arena, chunks, slot_ids) -> None:
    """Readable definition of store_hidden_chunks."""
    for c in range(slot_ids.shape[0]):
        hidden_arena[int(slot_ids[c])] = chunks[c].to(hidden_arena.device)
