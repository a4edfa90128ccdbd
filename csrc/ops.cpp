// hstu custom ops: schemas (TORCH_LIBRARY) and CPU kernels (TORCH_LIBRARY_IMPL CPU).
//
// Layouts (see kv_checks.h): kv_cache [L, P, 2, page_size, H, d]; host_arena
// [S, L, pages_per_chunk, 2, page_size, H, d]; hidden_arena [S, L, chunk_tokens, D] (a view of the
// host arena's slots); k/v [T, H, d]; every index tensor int32.
// A user's pages hold its tokens from position 0: token t lives in page pages[t / page_size] at
// offset t % page_size. CUDA kernels for the same schemas live in kernels/*.cu.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "kv_checks.h"

namespace hstu {
namespace {

// Writes each new token's K and V into its (page, offset) slot of one layer.
void append_kvcache_cpu(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& page_ids, const at::Tensor& page_offsets, int64_t layer,
                        const std::optional<at::Tensor>& rows, int64_t skip_page) {
  check_append(kv_cache, k, v, page_ids, page_offsets, layer, rows);
  if (page_ids.size(0) == 0) return;
  auto layer_cache = kv_cache.select(0, layer);  // [P, 2, ps, H, d]
  auto pages = page_ids.to(at::kLong);
  auto offsets = page_offsets.to(at::kLong);
  auto ks = rows ? k.index_select(0, *rows) : k;
  auto vs = rows ? v.index_select(0, *rows) : v;
  if (skip_page >= 0) {  // tokens bound for the skipped page are not written
    const auto keep = pages.ne(skip_page).nonzero().squeeze(1);
    pages = pages.index_select(0, keep);
    offsets = offsets.index_select(0, keep);
    ks = ks.index_select(0, keep);
    vs = vs.index_select(0, keep);
  }
  layer_cache.select(1, 0).index_put_({pages, offsets}, ks);
  layer_cache.select(1, 1).index_put_({pages, offsets}, vs);
}

// Pages -> contiguous jagged K and V ([sum_len, H, d] each) of one layer.
std::tuple<at::Tensor, at::Tensor> gather_kvcache_cpu(const at::Tensor& kv_cache, int64_t layer,
                                                      const at::Tensor& page_indices,
                                                      const at::Tensor& page_indptr,
                                                      const at::Tensor& last_page_len) {
  check_kv_cache(kv_cache);
  check_layer(kv_cache, layer);
  auto [pages, offsets] =
      token_slots_host(page_indices, page_indptr, last_page_len, kv_cache.size(3), kv_cache.size(1));
  auto opts = at::TensorOptions().dtype(at::kLong);
  const auto tp = at::tensor(pages, opts);
  const auto to = at::tensor(offsets, opts);
  auto layer_cache = kv_cache.select(0, layer);
  auto k = layer_cache.select(1, 0).index({tp, to});
  auto v = layer_cache.select(1, 1).index({tp, to});
  return {k, v};
}

// All layers of whole pages, chunk by chunk: out[c, l, p] = kv_cache[l, page_ids[c, p]].
at::Tensor gather_kvcache_all_layers_cpu(const at::Tensor& kv_cache, const at::Tensor& page_ids) {
  check_kv_cache(kv_cache);
  check_chunk_pages(kv_cache, page_ids);
  const auto flat = page_ids.reshape({-1}).to(at::kLong);
  auto gathered = kv_cache.index_select(1, flat);  // [L, n*ppc, 2, ps, H, d]
  auto sizes = kv_cache.sizes().vec();
  gathered = gathered.view({sizes[0], page_ids.size(0), page_ids.size(1), 2, sizes[3], sizes[4], sizes[5]});
  return gathered.transpose(0, 1).contiguous();
}

// Host chunk slots -> pages of one layer: kv_cache[layer, page_ids[c, p]] = host_arena[slot_ids[c], layer, p].
void onload_kvcache_cpu(at::Tensor kv_cache, const at::Tensor& host_arena, const at::Tensor& slot_ids,
                        const at::Tensor& page_ids, int64_t layer) {
  check_onload(kv_cache, host_arena, slot_ids, page_ids, layer);
  if (slot_ids.numel() == 0) return;
  auto src = host_arena.select(1, layer).index_select(0, slot_ids.to(at::kLong));  // [n, ppc, 2, ps, H, d]
  src = src.flatten(0, 1);
  kv_cache.select(0, layer).index_copy_(0, page_ids.reshape({-1}).to(at::kLong), src);
}

// Gathered chunks -> host slots: host_arena[slot_ids[c]] = chunks[c].
void store_host_chunks_cpu(at::Tensor host_arena, const at::Tensor& chunks, const at::Tensor& slot_ids) {
  check_store(host_arena, chunks, slot_ids);
  if (slot_ids.numel() == 0) return;
  host_arena.index_copy_(0, slot_ids.to(at::kLong), chunks.to(host_arena.device()));
}

// Layer `layer` of hidden-state slots -> out: out[c] = hidden_arena[slot_ids[c], layer].
void onload_hidden_cpu(at::Tensor out, const at::Tensor& hidden_arena, const at::Tensor& slot_ids, int64_t layer) {
  check_onload_hidden(out, hidden_arena, slot_ids, layer);
  if (slot_ids.numel() == 0) return;
  out.copy_(hidden_arena.select(1, layer).index_select(0, slot_ids.to(at::kLong)));
}

// Hidden-state chunks -> host slots: hidden_arena[slot_ids[c]] = chunks[c].
void store_hidden_chunks_cpu(at::Tensor hidden_arena, const at::Tensor& chunks, const at::Tensor& slot_ids) {
  check_store_hidden(hidden_arena, chunks, slot_ids);
  if (slot_ids.numel() == 0) return;
  hidden_arena.index_copy_(0, slot_ids.to(at::kLong), chunks.to(hidden_arena.device()));
}

// src -> dst (the CUDA impls copy between a device tensor and pinned host memory with a kernel:
// write_pinned device -> host, read_pinned host -> device).
void pinned_copy_cpu(at::Tensor dst, const at::Tensor& src) {
  check_pinned_copy(dst, src);
  dst.copy_(src);
}

}  // namespace

TORCH_LIBRARY(hstu, m) {
  m.def("append_kvcache(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor page_ids, Tensor page_offsets, "
        "int layer, Tensor? rows=None, int skip_page=-1) -> ()");
  m.def("gather_kvcache(Tensor kv_cache, int layer, Tensor page_indices, Tensor page_indptr, "
        "Tensor last_page_len) -> (Tensor, Tensor)");
  m.def("gather_kvcache_all_layers(Tensor kv_cache, Tensor page_ids) -> Tensor");
  m.def("onload_kvcache(Tensor(a!) kv_cache, Tensor host_arena, Tensor slot_ids, Tensor page_ids, "
        "int layer) -> ()");
  m.def("store_host_chunks(Tensor(a!) host_arena, Tensor chunks, Tensor slot_ids) -> ()");
  m.def("onload_hidden(Tensor(a!) out, Tensor hidden_arena, Tensor slot_ids, int layer) -> ()");
  m.def("store_hidden_chunks(Tensor(a!) hidden_arena, Tensor chunks, Tensor slot_ids) -> ()");
  m.def("write_pinned(Tensor(a!) dst, Tensor src) -> ()");
  m.def("read_pinned(Tensor(a!) dst, Tensor src) -> ()");
}

TORCH_LIBRARY_IMPL(hstu, CPU, m) {
  m.impl("append_kvcache", &append_kvcache_cpu);
  m.impl("gather_kvcache", &gather_kvcache_cpu);
  m.impl("gather_kvcache_all_layers", &gather_kvcache_all_layers_cpu);
  m.impl("onload_kvcache", &onload_kvcache_cpu);
  m.impl("store_host_chunks", &store_host_chunks_cpu);
  m.impl("onload_hidden", &onload_hidden_cpu);
  m.impl("store_hidden_chunks", &store_hidden_chunks_cpu);
  m.impl("write_pinned", &pinned_copy_cpu);
  m.impl("read_pinned", &pinned_copy_cpu);
}

}  // namespace hstu
