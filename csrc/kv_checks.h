// Shape, dtype and device checks shared by the CPU (ops.cpp) and CUDA (kernels/*.cu) impls.
//
// Layouts these ops assume (row-major, contiguous):
//   kv_cache    [L, P, 2, page_size, H, d]              GPU page table (index 0 = K, 1 = V)
//   host_arena  [S, L, pages_per_chunk, 2, page_size, H, d]  host chunk slots (page images)
//   k, v        [T, H, d]                               new tokens' keys / values (jagged batch)
// Index tensors are int32. Errors name the offending values.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace hstu {

inline void check_kv_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(2) == 2,
              "kv_cache must be [L, P, 2, page_size, H, d], got ", kv_cache.sizes());
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16 ||
                  kv_cache.scalar_type() == at::kHalf,
              "kv_cache dtype must be float32, bfloat16 or float16, got ", kv_cache.scalar_type());
}

inline void check_layer(const at::Tensor& kv_cache, int64_t layer) {
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "layer ", layer, " out of range [0, ",
              kv_cache.size(0), ")");
}

inline void check_index(const at::Tensor& idx, const char* name, int64_t dim) {
  TORCH_CHECK(idx.scalar_type() == at::kInt, name, " must be int32, got ", idx.scalar_type());
  TORCH_CHECK(idx.dim() == dim, name, " must have ", dim, " dims, got ", idx.sizes());
  TORCH_CHECK(idx.is_contiguous(), name, " must be contiguous");
}

// Host-side range check; only call on CPU tensors (a device tensor would force a sync).
inline void check_range_cpu(const at::Tensor& idx, const char* name, int64_t upper) {
  if (idx.numel() == 0 || !idx.is_cpu()) return;
  const int64_t lo = idx.min().item<int64_t>();
  const int64_t hi = idx.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < upper, name, " values must lie in [0, ", upper, "), got min ", lo,
              " max ", hi);
}

inline void check_append(const at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& page_ids, const at::Tensor& page_offsets, int64_t layer) {
  check_kv_cache(kv_cache);
  check_layer(kv_cache, layer);
  check_index(page_ids, "page_ids", 1);
  check_index(page_offsets, "page_offsets", 1);
  const int64_t T = k.size(0);
  TORCH_CHECK(k.dim() == 3 && k.size(1) == kv_cache.size(4) && k.size(2) == kv_cache.size(5),
              "k must be [T, H=", kv_cache.size(4), ", d=", kv_cache.size(5), "], got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "v must match k ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "k/v dtype ", k.scalar_type(), "/", v.scalar_type(), " must equal kv_cache dtype ",
              kv_cache.scalar_type());
  TORCH_CHECK(page_ids.size(0) == T && page_offsets.size(0) == T, "page_ids/page_offsets need ", T,
              " entries, got ", page_ids.size(0), "/", page_offsets.size(0));
  TORCH_CHECK(k.device() == kv_cache.device() && page_ids.device() == kv_cache.device() &&
                  page_offsets.device() == kv_cache.device(),
              "append_kvcache tensors must share kv_cache's device ", kv_cache.device());
  check_range_cpu(page_ids, "page_ids", kv_cache.size(1));
  check_range_cpu(page_offsets, "page_offsets", kv_cache.size(3));
}

inline void check_host_arena(const at::Tensor& kv_cache, const at::Tensor& host_arena) {
  TORCH_CHECK(host_arena.dim() == 7, "host_arena must be [S, L, pages_per_chunk, 2, page_size, H, d], got ",
              host_arena.sizes());
  TORCH_CHECK(host_arena.is_contiguous(), "host_arena must be contiguous");
  TORCH_CHECK(host_arena.size(1) == kv_cache.size(0) && host_arena.size(3) == 2 &&
                  host_arena.size(4) == kv_cache.size(3) && host_arena.size(5) == kv_cache.size(4) &&
                  host_arena.size(6) == kv_cache.size(5),
              "host_arena ", host_arena.sizes(), " does not match kv_cache ", kv_cache.sizes());
  TORCH_CHECK(host_arena.scalar_type() == kv_cache.scalar_type(), "host_arena dtype ",
              host_arena.scalar_type(), " must equal kv_cache dtype ", kv_cache.scalar_type());
}

inline void check_chunk_pages(const at::Tensor& kv_cache, const at::Tensor& page_ids) {
  check_index(page_ids, "page_ids", 2);
  check_range_cpu(page_ids, "page_ids", kv_cache.size(1));
}

inline void check_onload(const at::Tensor& kv_cache, const at::Tensor& host_arena,
                         const at::Tensor& slot_ids, const at::Tensor& page_ids, int64_t layer) {
  check_kv_cache(kv_cache);
  check_layer(kv_cache, layer);
  check_host_arena(kv_cache, host_arena);
  check_index(slot_ids, "slot_ids", 1);
  check_chunk_pages(kv_cache, page_ids);
  TORCH_CHECK(page_ids.size(0) == slot_ids.size(0) && page_ids.size(1) == host_arena.size(2),
              "page_ids must be [n_chunks=", slot_ids.size(0), ", pages_per_chunk=", host_arena.size(2),
              "], got ", page_ids.sizes());
  check_range_cpu(slot_ids, "slot_ids", host_arena.size(0));
}

inline void check_store(const at::Tensor& host_arena, const at::Tensor& chunks, const at::Tensor& slot_ids) {
  TORCH_CHECK(host_arena.dim() == 7 && host_arena.is_contiguous(),
              "host_arena must be a contiguous [S, L, pages_per_chunk, 2, page_size, H, d], got ",
              host_arena.sizes());
  TORCH_CHECK(chunks.dim() == 7 && chunks.sizes().slice(1) == host_arena.sizes().slice(1),
              "chunks must be [n, ", host_arena.sizes().slice(1), "], got ", chunks.sizes());
  TORCH_CHECK(chunks.scalar_type() == host_arena.scalar_type(), "chunks dtype ", chunks.scalar_type(),
              " must equal host_arena dtype ", host_arena.scalar_type());
  check_index(slot_ids, "slot_ids", 1);
  TORCH_CHECK(slot_ids.size(0) == chunks.size(0), "slot_ids needs ", chunks.size(0), " entries, got ",
              slot_ids.size(0));
  check_range_cpu(slot_ids, "slot_ids", host_arena.size(0));
}

}  // namespace hstu
