// Shape, dtype and device checks shared by the CPU (ops.cpp) and CUDA (kernels/*.cu) impls.
//
// Layouts these ops assume (row-major, contiguous):
//   kv_cache    [L, P, 2, page_size, H, d]              GPU page table (index 0 = K, 1 = V)
//   host_arena  [S, L, pages_per_chunk, 2, page_size, H, d]  host chunk slots (page images)
//   k, v        [T, H, d]                               new tokens' keys / values (jagged batch)
//   hidden_arena [S, L, chunk_tokens, D]                 hidden-state chunks (check_hidden_arena)
// Index tensors are int32 (append_kvcache's rows: int64, as the metadata holds them). Errors name the
// offending values.
//
// Messages format integers with std::to_string (num/dims below), never through ostream's
// operator<<(long): on the GPU image an extension built by nvcc crashed inside its own copy of
// std::ostream::_M_insert<long> when a TORCH_CHECK message streamed an integer.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace hstu {

inline std::string num(int64_t v) { return std::to_string(v); }

// A bad argument of a pybind11-bound host function: std::invalid_argument, a ValueError in Python
// (TORCH_CHECK's c10::Error would be a RuntimeError).
inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

inline std::string dims(at::IntArrayRef sizes) {
  std::string out = "[";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + "]";
}

inline void check_kv_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(2) == 2,
              "kv_cache must be [L, P, 2, page_size, H, d], got ", dims(kv_cache.sizes()));
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16 ||
                  kv_cache.scalar_type() == at::kHalf,
              "kv_cache dtype must be float32, bfloat16 or float16, got ", kv_cache.scalar_type());
}

inline void check_layer(const at::Tensor& kv_cache, int64_t layer) {
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "layer ", num(layer), " out of range [0, ",
              num(kv_cache.size(0)), ")");
}

inline void check_index(const at::Tensor& idx, const char* name, int64_t dim) {
  TORCH_CHECK(idx.scalar_type() == at::kInt, name, " must be int32, got ", idx.scalar_type());
  TORCH_CHECK(idx.dim() == dim, name, " must have ", num(dim), " dims, got ", dims(idx.sizes()));
  TORCH_CHECK(idx.is_contiguous(), name, " must be contiguous");
}

// Host-side range check; only call on CPU tensors (a device tensor would force a sync).
inline void check_range_cpu(const at::Tensor& idx, const char* name, int64_t upper) {
  if (idx.numel() == 0 || !idx.is_cpu()) return;
  const int64_t lo = idx.min().item<int64_t>();
  const int64_t hi = idx.max().item<int64_t>();
  TORCH_CHECK(lo >= 0 && hi < upper, name, " values must lie in [0, ", num(upper), "), got min ", num(lo),
              " max ", num(hi));
}

// rows (optional, int64 [n]): token t's K/V are row rows[t] of k and v, which may hold any number of
// rows (a layer's whole projection); without it, k and v are the n tokens themselves.
inline void check_append(const at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& page_ids, const at::Tensor& page_offsets, int64_t layer,
                         const std::optional<at::Tensor>& rows) {
  check_kv_cache(kv_cache);
  check_layer(kv_cache, layer);
  check_index(page_ids, "page_ids", 1);
  check_index(page_offsets, "page_offsets", 1);
  TORCH_CHECK(k.dim() == 3 && k.size(1) == kv_cache.size(4) && k.size(2) == kv_cache.size(5),
              "k must be [T, H=", num(kv_cache.size(4)), ", d=", num(kv_cache.size(5)), "], got ", dims(k.sizes()));
  TORCH_CHECK(v.sizes() == k.sizes(), "v must match k ", dims(k.sizes()), ", got ", dims(v.sizes()));
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == kv_cache.scalar_type(),
              "k/v dtype ", k.scalar_type(), "/", v.scalar_type(), " must equal kv_cache dtype ",
              kv_cache.scalar_type());
  const int64_t n = rows ? rows->numel() : k.size(0);
  TORCH_CHECK(page_ids.size(0) == n && page_offsets.size(0) == n, "page_ids/page_offsets need ", num(n),
              " entries, got ", num(page_ids.size(0)), "/", num(page_offsets.size(0)));
  TORCH_CHECK(k.device() == kv_cache.device() && page_ids.device() == kv_cache.device() &&
                  page_offsets.device() == kv_cache.device(),
              "append_kvcache tensors must share kv_cache's device ", kv_cache.device());
  if (rows) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->is_contiguous(),
                "rows must be a contiguous 1-d int64 tensor, got ", rows->scalar_type(), " ", dims(rows->sizes()));
    TORCH_CHECK(rows->device() == kv_cache.device(), "rows must be on kv_cache's device ", kv_cache.device());
    check_range_cpu(*rows, "rows", k.size(0));
  }
  check_range_cpu(page_ids, "page_ids", kv_cache.size(1));
  check_range_cpu(page_offsets, "page_offsets", kv_cache.size(3));
}

inline void check_host_arena(const at::Tensor& kv_cache, const at::Tensor& host_arena) {
  TORCH_CHECK(host_arena.dim() == 7, "host_arena must be [S, L, pages_per_chunk, 2, page_size, H, d], got ",
              dims(host_arena.sizes()));
  TORCH_CHECK(host_arena.is_contiguous(), "host_arena must be contiguous");
  TORCH_CHECK(host_arena.size(1) == kv_cache.size(0) && host_arena.size(3) == 2 &&
                  host_arena.size(4) == kv_cache.size(3) && host_arena.size(5) == kv_cache.size(4) &&
                  host_arena.size(6) == kv_cache.size(5),
              "host_arena ", dims(host_arena.sizes()), " does not match kv_cache ", dims(kv_cache.sizes()));
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
              "page_ids must be [n_chunks=", num(slot_ids.size(0)), ", pages_per_chunk=", num(host_arena.size(2)),
              "], got ", dims(page_ids.sizes()));
  check_range_cpu(slot_ids, "slot_ids", host_arena.size(0));
}

// chunks [n, <arena's slot shape>] stored into slots slot_ids [n] of `arena` (named `name`): the
// checks check_store and check_store_hidden share once their arena's layout is checked.
inline void check_chunks_into_slots(const at::Tensor& arena, const char* name, const at::Tensor& chunks,
                                    const at::Tensor& slot_ids) {
  TORCH_CHECK(chunks.dim() == arena.dim() && chunks.sizes().slice(1) == arena.sizes().slice(1),
              "chunks must be [n, ", dims(arena.sizes().slice(1)), "], got ", dims(chunks.sizes()));
  TORCH_CHECK(chunks.scalar_type() == arena.scalar_type(), "chunks dtype ", chunks.scalar_type(), " must equal ",
              name, " dtype ", arena.scalar_type());
  check_index(slot_ids, "slot_ids", 1);
  TORCH_CHECK(slot_ids.size(0) == chunks.size(0), "slot_ids needs ", num(chunks.size(0)), " entries, got ",
              num(slot_ids.size(0)));
  check_range_cpu(slot_ids, "slot_ids", arena.size(0));
}

inline void check_store(const at::Tensor& host_arena, const at::Tensor& chunks, const at::Tensor& slot_ids) {
  TORCH_CHECK(host_arena.dim() == 7 && host_arena.is_contiguous(),
              "host_arena must be a contiguous [S, L, pages_per_chunk, 2, page_size, H, d], got ",
              dims(host_arena.sizes()));
  check_chunks_into_slots(host_arena, "host_arena", chunks, slot_ids);
}

// hidden_arena [S, L, chunk_tokens, D]: the host tier's hidden-state chunks (each layer's input
// rows), a view of the host arena's slots: every slot's [L, chunk_tokens, D] block contiguous, the
// slots any stride apart (one per host-arena slot, whose first L * chunk_tokens * D elements it uses).
inline void check_hidden_arena(const at::Tensor& hidden_arena) {
  TORCH_CHECK(hidden_arena.dim() == 4, "hidden_arena must be [S, L, chunk_tokens, D], got ",
              dims(hidden_arena.sizes()));
  const int64_t D = hidden_arena.size(3), ct = hidden_arena.size(2), L = hidden_arena.size(1);
  TORCH_CHECK(hidden_arena.stride(3) == 1 && hidden_arena.stride(2) == D && hidden_arena.stride(1) == ct * D &&
                  hidden_arena.stride(0) >= L * ct * D,
              "hidden_arena's [L, chunk_tokens, D] blocks must be contiguous, got strides ",
              dims(hidden_arena.strides()));
  TORCH_CHECK(hidden_arena.scalar_type() == at::kFloat || hidden_arena.scalar_type() == at::kBFloat16 ||
                  hidden_arena.scalar_type() == at::kHalf,
              "hidden_arena dtype must be float32, bfloat16 or float16, got ", hidden_arena.scalar_type());
}

// onload_hidden: out [n, chunk_tokens, D] (contiguous, hidden_arena's dtype) <- layer `layer` of
// slots slot_ids [n].
inline void check_onload_hidden(const at::Tensor& out, const at::Tensor& hidden_arena, const at::Tensor& slot_ids,
                                int64_t layer) {
  check_hidden_arena(hidden_arena);
  TORCH_CHECK(layer >= 0 && layer < hidden_arena.size(1), "layer ", num(layer), " out of range [0, ",
              num(hidden_arena.size(1)), ")");
  check_index(slot_ids, "slot_ids", 1);
  TORCH_CHECK(out.dim() == 3 && out.size(0) == slot_ids.size(0) && out.size(1) == hidden_arena.size(2) &&
                  out.size(2) == hidden_arena.size(3),
              "out must be [n_chunks=", num(slot_ids.size(0)), ", chunk_tokens=", num(hidden_arena.size(2)),
              ", D=", num(hidden_arena.size(3)), "], got ", dims(out.sizes()));
  TORCH_CHECK(out.is_contiguous(), "out must be contiguous");
  TORCH_CHECK(out.scalar_type() == hidden_arena.scalar_type(), "out dtype ", out.scalar_type(),
              " must equal hidden_arena dtype ", hidden_arena.scalar_type());
  check_range_cpu(slot_ids, "slot_ids", hidden_arena.size(0));
}

// store_hidden_chunks: hidden_arena[slot_ids[c]] <- chunks[c], chunks [n, L, chunk_tokens, D].
inline void check_store_hidden(const at::Tensor& hidden_arena, const at::Tensor& chunks, const at::Tensor& slot_ids) {
  check_hidden_arena(hidden_arena);
  check_chunks_into_slots(hidden_arena, "hidden_arena", chunks, slot_ids);
}

// Per-token (page, offset) of a jagged batch given as a CSR page list (CPU int32 tensors), checked:
// user b owns pages page_indices[page_indptr[b] : page_indptr[b+1]], its last holding
// last_page_len[b] tokens. Used by the CPU and CUDA gather_kvcache (a utility op, host-side math).
inline std::pair<std::vector<int64_t>, std::vector<int64_t>> token_slots_host(
    const at::Tensor& page_indices, const at::Tensor& page_indptr, const at::Tensor& last_page_len,
    int64_t page_size, int64_t num_pages) {
  check_index(page_indices, "page_indices", 1);
  check_index(page_indptr, "page_indptr", 1);
  check_index(last_page_len, "last_page_len", 1);
  const int64_t B = last_page_len.size(0);
  TORCH_CHECK(page_indptr.size(0) == B + 1, "page_indptr needs B+1=", num(B + 1), " entries, got ",
              num(page_indptr.size(0)));
  const auto pages = page_indices.cpu();
  const auto indptr = page_indptr.cpu();
  const auto last = last_page_len.cpu();
  check_range_cpu(pages, "page_indices", num_pages);
  const int32_t* ip = indptr.data_ptr<int32_t>();
  const int32_t* lp = last.data_ptr<int32_t>();
  const int32_t* pg = pages.data_ptr<int32_t>();
  TORCH_CHECK(ip[0] == 0 && ip[B] == pages.size(0), "page_indptr must run from 0 to ", num(pages.size(0)),
              ", got ", num(ip[0]), "..", num(ip[B]));
  std::vector<int64_t> tok_page, tok_off;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = ip[b + 1] - ip[b];
    TORCH_CHECK(n >= 0, "page_indptr must be non-decreasing at user ", num(b));
    if (n == 0) continue;
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= page_size, "last_page_len[", num(b), "]=", num(lp[b]),
                " must lie in [1, ", num(page_size), "]");
    for (int64_t p = 0; p < n; ++p) {
      const int64_t len = (p == n - 1) ? lp[b] : page_size;
      for (int64_t o = 0; o < len; ++o) {
        tok_page.push_back(pg[ip[b] + p]);
        tok_off.push_back(o);
      }
    }
  }
  return {std::move(tok_page), std::move(tok_off)};
}

// write_pinned, read_pinned: dst and src the same dtype and element count, both contiguous.
inline void check_pinned_copy(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "dst dtype ", dst.scalar_type(), " must equal src dtype ",
              src.scalar_type());
  TORCH_CHECK(dst.numel() == src.numel(), "dst holds ", num(dst.numel()), " elements but src ", num(src.numel()));
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "dst and src must be contiguous");
}

}  // namespace hstu
