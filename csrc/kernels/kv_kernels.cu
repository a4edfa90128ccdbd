// CUDA impls (TORCH_LIBRARY_IMPL(hstu, CUDA)) of the nine ops whose schemas and CPU impls live
// in ../ops.cpp. Checks are the shared ones of ../kv_checks.h.
//
// Layouts (row-major, contiguous unless noted):
//   kv_cache    [L, P, 2, page_size, H, d]                  device page table (K at 0, V at 1)
//   host_arena  [S, L, pages_per_chunk, 2, page_size, H, d]  host chunk slots (pinned CPU)
//   k, v        [T, H, d]                                   [H, d] contiguous, any token stride
//   chunks      [n, L, pages_per_chunk, 2, page_size, H, d] output of gather_kvcache_all_layers
//   hidden_arena [S, L, chunk_tokens, D]                 pinned CPU view of the host arena's slots:
//                                                         each slot's block contiguous, slots
//                                                         stride(0) apart (onload_hidden,
//                                                         store_hidden_chunks: copies, no kernel)
//   index tensors int32
// A token row (H*d elements) and a page image (2*page_size*H*d elements, K and V of one layer)
// are contiguous on every side, so every op is a list of "items" (rows or pages) copied from one
// address to another. One kernel does that for all device-side ops: an op's Addr functor maps an
// item to its source and destination, each thread group copies one item with 16-byte (uint4)
// accesses when every address and the item size are multiples of 16 bytes, with 4- or 2-byte
// accesses otherwise, several loads in flight before their stores.
//
// Where the index tensors live:
//   append_kvcache, gather_kvcache_all_layers: on kv_cache's device (no host sync).
//   gather_kvcache: any device; the per-token slots are computed on the host from CPU copies
//     (a sync; the op serves tests and utilities only).
//   onload_kvcache, store_host_chunks: on the CPU (the host arena is CPU memory; the caller builds
//     them on the host). onload_kvcache has two variants, chosen per call by HSTU_ONLOAD_IMPL:
//       memcpy   (default) cudaMemcpyAsync per run of consecutive pages (one cudaMemcpyBatchAsync
//                call for all runs when CUDA >= 12.8, the arena is pinned and the stream is not
//                the legacy default stream); uses the copy engines, not SMs.
//       zerocopy one kernel reading the pinned arena through its device pointer
//                (cudaHostGetDevicePointer); requires host_arena.is_pinned().
//     Measured on H200 (benchmarks/RESULTS.md): memcpy 0.99 of the pinned H2D ceiling, zerocopy
//     0.91, for pages in runs of a chunk and for scattered pages alike.
//   write_pinned: src on the GPU, dst pinned CPU memory, written by a kernel through dst's mapped
//     address (no copy engine: a small result never queues behind a bulk D2H, such as an
//     offload, that another stream put on the engine first). The host allocator is told the
//     stream, so dst's block is not handed out again before the kernel completed.
//   read_pinned: the reverse, src pinned CPU memory read by a kernel through its mapped address into
//     dst on the GPU (a CUDA-graph batch's staged inputs: no copy engine, so they never queue
//     behind the batch's own onload copies, which may then be enqueued first). Its host cost is
//     that of copy_ (5.5 against 3.7-5.2 us a call for 16-256 KB on an H100 host, run GF).
// Every launch and copy is enqueued on at::cuda::getCurrentCUDAStream().
#include <ATen/ATen.h>
#include <ATen/core/CachingHostAllocator.h>  // at::getHostAllocator: write_pinned tells it dst's stream
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // at::cuda::getCurrentCUDAStream (at::cuda re-exports c10::cuda)
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../kv_checks.h"

namespace hstu {
namespace {

constexpr int kThreads = 256;  // threads per block
constexpr int kUnroll = 4;     // vector loads in flight per thread before the stores

// Item i is copied from Addr::src(i) to Addr::dst(i), `item_bytes` bytes each.
// Block layout: blockDim.x threads share an item (tx lanes) and blockDim.y items per block;
// grid.y splits one item over several blocks when items are few.
template <typename Vec, typename Addr>
__global__ void copy_items_kernel(Addr addr, int64_t n_items, int64_t vecs_per_item) {
  const int64_t lane = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int64_t lane_stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; item < n_items;
       item += static_cast<int64_t>(gridDim.x) * blockDim.y) {
    if (addr.skip(item)) continue;
    const Vec* __restrict__ src = reinterpret_cast<const Vec*>(addr.src(item));
    Vec* __restrict__ dst = reinterpret_cast<Vec*>(addr.dst(item));
    for (int64_t v0 = lane; v0 < vecs_per_item; v0 += lane_stride * kUnroll) {
      Vec buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * lane_stride;
        if (v < vecs_per_item) buf[u] = src[v];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * lane_stride;
        if (v < vecs_per_item) dst[v] = buf[u];
      }
    }
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Widest access (16, 4 or 2 bytes) that divides every byte quantity in `quantities`.
int vector_bytes(std::initializer_list<uint64_t> quantities) {
  uint64_t all = 0;
  for (uint64_t q : quantities) all |= q;
  if (all % 16 == 0) return 16;
  if (all % 4 == 0) return 4;
  TORCH_CHECK(all % 2 == 0, "KV copy needs 2-byte aligned addresses and sizes");
  return 2;
}

template <typename Vec, typename Addr>
void launch_copy(const Addr& addr, int64_t n_items, int64_t item_bytes, cudaStream_t stream) {
  const int64_t vecs = item_bytes / static_cast<int64_t>(sizeof(Vec));
  // Lanes per item: enough that each lane has kUnroll vectors in flight (a 2 KiB row: 32 lanes,
  // 8 rows a block; a 128 KiB page: 256 lanes), at least a warp.
  int tx = 32;
  while (tx < kThreads && static_cast<int64_t>(tx) * kUnroll < vecs) tx *= 2;
  const int ty = kThreads / tx;
  const int64_t item_blocks = ceil_div(n_items, ty);
  int device = 0, num_sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  // Enough blocks to fill the chip: split items over grid.y when there are few of them.
  const int64_t want = 4LL * num_sms;
  const int64_t split_max = std::max<int64_t>(1, ceil_div(vecs, static_cast<int64_t>(tx) * kUnroll));
  const int64_t split = std::min<int64_t>({split_max, std::max<int64_t>(1, ceil_div(want, item_blocks)), 65535});
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(item_blocks, 1LL << 30)), static_cast<unsigned>(split));
  const dim3 block(tx, ty);
  copy_items_kernel<Vec, Addr><<<grid, block, 0, stream>>>(addr, n_items, vecs);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Copies n_items items of item_bytes each with vec_bytes-wide accesses (see vector_bytes).
template <typename Addr>
void copy_items(const Addr& addr, int64_t n_items, int64_t item_bytes, int vec_bytes, cudaStream_t stream) {
  if (n_items == 0 || item_bytes == 0) return;
  switch (vec_bytes) {
    case 16: launch_copy<uint4>(addr, n_items, item_bytes, stream); break;
    case 4: launch_copy<uint32_t>(addr, n_items, item_bytes, stream); break;
    default: launch_copy<uint16_t>(addr, n_items, item_bytes, stream); break;
  }
}

uint64_t addr_of(const void* p) { return reinterpret_cast<uint64_t>(p); }

// append_kvcache: item i = (token i/2, K or V by i%2) -> kv_cache[layer, page, kv, offset]; the
// token's row of k / v is rows[t] when rows is given (else t); tokens bound for skip_page (a CUDA
// graph bucket's padding, written to the scratch page otherwise) are not copied.
struct AppendAddr {
  const char* k;
  const char* v;
  char* layer_base;  // kv_cache[layer]
  const int32_t* page_ids;
  const int32_t* offsets;
  const int64_t* rows;  // nullptr: token t is row t
  int64_t skip_page;    // -1: none
  int64_t k_stride, v_stride;  // bytes between tokens
  int64_t row_bytes, page_size;
  __device__ bool skip(int64_t i) const { return page_ids[i >> 1] == skip_page; }
  __device__ const char* src(int64_t i) const {
    const int64_t t = rows ? rows[i >> 1] : (i >> 1);
    return (i & 1) ? v + t * v_stride : k + t * k_stride;
  }
  __device__ char* dst(int64_t i) const {
    const int64_t t = i >> 1;
    const int64_t slot = (static_cast<int64_t>(page_ids[t]) * 2 + (i & 1)) * page_size + offsets[t];
    return layer_base + slot * row_bytes;
  }
};

// [T, H, d] with [H, d] contiguous, or a contiguous copy of it.
at::Tensor rows_view(const at::Tensor& x) {
  if (x.stride(2) == 1 && x.stride(1) == x.size(2)) return x;
  return x.contiguous();
}

void append_kvcache_cuda(at::Tensor kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& page_ids,
                         const at::Tensor& page_offsets, int64_t layer, const std::optional<at::Tensor>& rows,
                         int64_t skip_page) {
  check_append(kv_cache, k, v, page_ids, page_offsets, layer, rows);
  const int64_t T = page_ids.size(0);
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const auto kr = rows_view(k);
  const auto vr = rows_view(v);
  const int64_t es = kv_cache.element_size();
  const int64_t row_bytes = kv_cache.size(4) * kv_cache.size(5) * es;
  const int64_t layer_bytes = kv_cache.stride(0) * es;
  AppendAddr addr{static_cast<const char*>(kr.data_ptr()),
                  static_cast<const char*>(vr.data_ptr()),
                  static_cast<char*>(kv_cache.data_ptr()) + layer * layer_bytes,
                  page_ids.data_ptr<int32_t>(),
                  page_offsets.data_ptr<int32_t>(),
                  rows ? rows->data_ptr<int64_t>() : nullptr,
                  skip_page,
                  kr.stride(0) * es,
                  vr.stride(0) * es,
                  row_bytes,
                  kv_cache.size(3)};
  const int vec = vector_bytes({addr_of(addr.k), addr_of(addr.v), addr_of(addr.layer_base),
                                static_cast<uint64_t>(addr.k_stride), static_cast<uint64_t>(addr.v_stride),
                                static_cast<uint64_t>(row_bytes)});
  copy_items(addr, 2 * T, row_bytes, vec, at::cuda::getCurrentCUDAStream());
}

// gather_kvcache: item i = (token i/2, K or V) from its slot to out_k / out_v row.
struct GatherRowsAddr {
  __device__ bool skip(int64_t) const { return false; }  // copies every item
  const char* layer_base;
  char* out_k;
  char* out_v;
  const int64_t* slots;  // [2 * N]: (page, offset) of each token
  int64_t row_bytes, page_size;
  __device__ const char* src(int64_t i) const {
    const int64_t t = i >> 1;
    const int64_t page = slots[2 * t], off = slots[2 * t + 1];
    return layer_base + ((page * 2 + (i & 1)) * page_size + off) * row_bytes;
  }
  __device__ char* dst(int64_t i) const {
    const int64_t t = i >> 1;
    return ((i & 1) ? out_v : out_k) + t * row_bytes;
  }
};

std::tuple<at::Tensor, at::Tensor> gather_kvcache_cuda(const at::Tensor& kv_cache, int64_t layer,
                                                       const at::Tensor& page_indices, const at::Tensor& page_indptr,
                                                       const at::Tensor& last_page_len) {
  check_kv_cache(kv_cache);
  check_layer(kv_cache, layer);
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const int64_t page_size = kv_cache.size(3);
  const auto [tok_page, tok_off] =
      token_slots_host(page_indices, page_indptr, last_page_len, page_size, kv_cache.size(1));
  std::vector<int64_t> slots;  // (page, offset) pairs, interleaved
  slots.reserve(2 * tok_page.size());
  for (size_t t = 0; t < tok_page.size(); ++t) {
    slots.push_back(tok_page[t]);
    slots.push_back(tok_off[t]);
  }
  const int64_t N = static_cast<int64_t>(slots.size() / 2);
  const int64_t H = kv_cache.size(4), d = kv_cache.size(5);
  auto out_k = at::empty({N, H, d}, kv_cache.options());
  auto out_v = at::empty({N, H, d}, kv_cache.options());
  if (N == 0) return {out_k, out_v};
  const auto slots_dev =
      at::from_blob(slots.data(), {2 * N}, at::TensorOptions().dtype(at::kLong)).to(kv_cache.device());
  const int64_t es = kv_cache.element_size();
  const int64_t row_bytes = H * d * es;
  GatherRowsAddr addr{static_cast<const char*>(kv_cache.data_ptr()) + layer * kv_cache.stride(0) * es,
                      static_cast<char*>(out_k.data_ptr()), static_cast<char*>(out_v.data_ptr()),
                      slots_dev.data_ptr<int64_t>(), row_bytes, page_size};
  const int vec = vector_bytes({addr_of(addr.layer_base), addr_of(addr.out_k), addr_of(addr.out_v),
                                static_cast<uint64_t>(row_bytes)});
  copy_items(addr, 2 * N, row_bytes, vec, at::cuda::getCurrentCUDAStream());
  return {out_k, out_v};
}

// gather_kvcache_all_layers: item i = (chunk c, layer l, page p) in output order.
struct GatherAllAddr {
  __device__ bool skip(int64_t) const { return false; }  // copies every item
  const char* cache;
  char* out;
  const int32_t* page_ids;  // [n, ppc]
  int64_t num_layers, num_pages, ppc, page_bytes;
  __device__ const char* src(int64_t i) const {
    const int64_t p = i % ppc;
    const int64_t cl = i / ppc;
    const int64_t l = cl % num_layers, c = cl / num_layers;
    return cache + (l * num_pages + page_ids[c * ppc + p]) * page_bytes;
  }
  __device__ char* dst(int64_t i) const { return out + i * page_bytes; }
};

int64_t page_bytes_of(const at::Tensor& kv_cache) { return kv_cache.stride(1) * kv_cache.element_size(); }

at::Tensor gather_kvcache_all_layers_cuda(const at::Tensor& kv_cache, const at::Tensor& page_ids) {
  check_kv_cache(kv_cache);
  check_chunk_pages(kv_cache, page_ids);
  TORCH_CHECK(page_ids.device() == kv_cache.device(), "page_ids must be on kv_cache's device ", kv_cache.device(),
              ", got ", page_ids.device());
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const int64_t n = page_ids.size(0), ppc = page_ids.size(1), L = kv_cache.size(0);
  auto out = at::empty({n, L, ppc, 2, kv_cache.size(3), kv_cache.size(4), kv_cache.size(5)}, kv_cache.options());
  const int64_t page_bytes = page_bytes_of(kv_cache);
  GatherAllAddr addr{static_cast<const char*>(kv_cache.data_ptr()), static_cast<char*>(out.data_ptr()),
                     page_ids.data_ptr<int32_t>(), L, kv_cache.size(1), ppc, page_bytes};
  const int vec = vector_bytes({addr_of(addr.cache), addr_of(addr.out), static_cast<uint64_t>(page_bytes)});
  copy_items(addr, n * L * ppc, page_bytes, vec, at::cuda::getCurrentCUDAStream());
  return out;
}

// onload_kvcache zero-copy: item i = (chunk i/ppc, page i%ppc), read from mapped host memory.
struct OnloadAddr {
  __device__ bool skip(int64_t) const { return false; }  // copies every item
  const char* arena;  // device pointer of host_arena
  char* layer_base;   // kv_cache[layer]
  const int32_t* idx; // [n] slot ids then [n*ppc] page ids
  int64_t n, ppc, num_layers, layer, page_bytes;
  __device__ const char* src(int64_t i) const {
    const int64_t c = i / ppc, p = i % ppc;
    return arena + ((static_cast<int64_t>(idx[c]) * num_layers + layer) * ppc + p) * page_bytes;
  }
  __device__ char* dst(int64_t i) const { return layer_base + static_cast<int64_t>(idx[n + i]) * page_bytes; }
};

enum class OnloadImpl { kMemcpy, kZeroCopy };

OnloadImpl onload_impl() {
  const char* env = std::getenv("HSTU_ONLOAD_IMPL");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "memcpy") == 0) return OnloadImpl::kMemcpy;
  if (std::strcmp(env, "zerocopy") == 0) return OnloadImpl::kZeroCopy;
  TORCH_CHECK(false, "HSTU_ONLOAD_IMPL must be 'memcpy' or 'zerocopy', got '", env, "'");
}

struct CopyRun {
  void* dst;
  const void* src;
  size_t bytes;
};

// Appends (dst, src, bytes) to runs, extending the last run when both sides continue it.
void add_run(std::vector<CopyRun>& runs, void* dst, const void* src, size_t bytes) {
  if (!runs.empty()) {
    CopyRun& r = runs.back();
    if (static_cast<char*>(r.dst) + r.bytes == dst && static_cast<const char*>(r.src) + r.bytes == src) {
      r.bytes += bytes;
      return;
    }
  }
  runs.push_back({dst, src, bytes});
}

// Enqueues the runs on `stream`: one cudaMemcpyBatchAsync where available (CUDA >= 12.8, pinned
// host side, not the legacy default stream, which the batch API rejects), else one
// cudaMemcpyAsync per run (pageable host memory is then staged by the driver).
void enqueue_runs(const std::vector<CopyRun>& runs, cudaMemcpyKind kind, bool host_pinned, cudaStream_t stream) {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
  if (runs.size() > 1 && host_pinned && stream != nullptr && stream != cudaStreamLegacy) {
    std::vector<void*> dsts(runs.size());
    std::vector<const void*> srcs(runs.size());
    std::vector<size_t> sizes(runs.size());
    for (size_t i = 0; i < runs.size(); ++i) {
      dsts[i] = runs[i].dst;
      srcs[i] = runs[i].src;
      sizes[i] = runs[i].bytes;
    }
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
    C10_CUDA_CHECK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), runs.size(), &attr, &attr_idx, 1,
                                        stream));
#else
    size_t fail_idx = 0;
    C10_CUDA_CHECK(cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(), runs.size(),
                                        &attr, &attr_idx, 1, &fail_idx, stream));
#endif
    return;
  }
#endif
  for (const CopyRun& r : runs) C10_CUDA_CHECK(cudaMemcpyAsync(r.dst, r.src, r.bytes, kind, stream));
}

// The address through which the current device reads and writes the host tensor `host` (its op and
// name in the messages; the caller checked it is pinned). The calling thread's first CUDA call may be
// this one: the engine process launches batches on its event loop's thread, which had made none when
// its first graph batch staged its inputs (run HD, 2026-12-06: that request failed). With no context
// current on the thread, cudaPointerGetAttributes answers without a device pointer, so cudaSetDevice
// (which since CUDA 12 makes the device's primary context current on the thread) runs first; the
// caller holds a CUDAGuard for the device.
void* mapped_address(const char* op, const at::Tensor& host, const char* host_name) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaSetDevice(device));
  cudaPointerAttributes attr{};
  C10_CUDA_CHECK(cudaPointerGetAttributes(&attr, host.data_ptr()));
  TORCH_CHECK(attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr, op, ": ", host_name,
              " is not pinned host memory mapped into the device's address space");
  return attr.devicePointer;
}

void onload_kvcache_cuda(at::Tensor kv_cache, const at::Tensor& host_arena, const at::Tensor& slot_ids,
                         const at::Tensor& page_ids, int64_t layer) {
  TORCH_CHECK(kv_cache.is_cuda() && host_arena.is_cpu() && slot_ids.is_cpu() && page_ids.is_cpu(),
              "onload_kvcache on CUDA takes kv_cache on the GPU and host_arena, slot_ids, page_ids on the CPU, got ",
              kv_cache.device(), ", ", host_arena.device(), ", ", slot_ids.device(), ", ", page_ids.device());
  check_onload(kv_cache, host_arena, slot_ids, page_ids, layer);
  const int64_t n = slot_ids.size(0), ppc = page_ids.size(1), L = kv_cache.size(0);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t page_bytes = page_bytes_of(kv_cache);
  char* layer_base = static_cast<char*>(kv_cache.data_ptr()) + layer * kv_cache.stride(0) * kv_cache.element_size();
  const int32_t* slots = slot_ids.data_ptr<int32_t>();
  const int32_t* pages = page_ids.data_ptr<int32_t>();

  if (onload_impl() == OnloadImpl::kMemcpy) {
    const char* arena = static_cast<const char*>(host_arena.data_ptr());
    std::vector<CopyRun> runs;
    runs.reserve(static_cast<size_t>(n));
    for (int64_t c = 0; c < n; ++c) {
      for (int64_t p = 0; p < ppc; ++p) {
        const char* src = arena + ((static_cast<int64_t>(slots[c]) * L + layer) * ppc + p) * page_bytes;
        char* dst = layer_base + static_cast<int64_t>(pages[c * ppc + p]) * page_bytes;
        add_run(runs, dst, src, static_cast<size_t>(page_bytes));
      }
    }
    enqueue_runs(runs, cudaMemcpyHostToDevice, host_arena.is_pinned(), stream);
    return;
  }

  TORCH_CHECK(host_arena.is_pinned(), "HSTU_ONLOAD_IMPL=zerocopy needs a pinned host_arena (pin_memory=True)");
  const void* arena_dev = mapped_address("onload_kvcache", host_arena, "host_arena");
  // Slot ids then page ids, staged in pinned memory so the H2D copy is asynchronous; the caching
  // host allocator keeps the buffer alive until the copy on `stream` completed.
  auto idx_host = at::empty({n + n * ppc}, at::TensorOptions().dtype(at::kInt).pinned_memory(true));
  std::memcpy(idx_host.data_ptr<int32_t>(), slots, n * sizeof(int32_t));
  std::memcpy(idx_host.data_ptr<int32_t>() + n, pages, n * ppc * sizeof(int32_t));
  const auto idx = idx_host.to(kv_cache.device(), at::kInt, /*non_blocking=*/true);
  OnloadAddr addr{static_cast<const char*>(arena_dev), layer_base, idx.data_ptr<int32_t>(), n, ppc, L, layer,
                  page_bytes};
  const int vec = vector_bytes({addr_of(arena_dev), addr_of(layer_base), static_cast<uint64_t>(page_bytes)});
  copy_items(addr, n * ppc, page_bytes, vec, stream);
}

// Chunks (device) -> host slots: chunk c's chunk_bytes to `arena` + slot_ids[c] * slot_stride_bytes
// (pinned or not). One D2H run per chunk, merged where both sides continue.
void store_chunks_in_slots(const at::Tensor& arena_tensor, int64_t slot_stride_bytes, int64_t chunk_bytes,
                           const at::Tensor& chunks, const at::Tensor& slot_ids) {
  const int64_t n = slot_ids.size(0);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(chunks.device());
  const auto src = chunks.contiguous();
  const int32_t* slots = slot_ids.data_ptr<int32_t>();
  char* arena = static_cast<char*>(arena_tensor.data_ptr());
  const char* base = static_cast<const char*>(src.data_ptr());
  std::vector<CopyRun> runs;
  runs.reserve(static_cast<size_t>(n));
  for (int64_t c = 0; c < n; ++c) {
    add_run(runs, arena + static_cast<int64_t>(slots[c]) * slot_stride_bytes, base + c * chunk_bytes,
            static_cast<size_t>(chunk_bytes));
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // A temporary contiguous `src` may be freed on return: the allocator reuses it only for work
  // enqueued later on this stream, which runs after the copy.
  enqueue_runs(runs, cudaMemcpyDeviceToHost, arena_tensor.is_pinned(), stream);
}

void store_host_chunks_cuda(at::Tensor host_arena, const at::Tensor& chunks, const at::Tensor& slot_ids) {
  TORCH_CHECK(chunks.is_cuda() && host_arena.is_cpu() && slot_ids.is_cpu(),
              "store_host_chunks on CUDA takes chunks on the GPU and host_arena, slot_ids on the CPU, got ",
              chunks.device(), ", ", host_arena.device(), ", ", slot_ids.device());
  check_store(host_arena, chunks, slot_ids);
  const int64_t chunk_bytes = host_arena.stride(0) * host_arena.element_size();
  store_chunks_in_slots(host_arena, chunk_bytes, chunk_bytes, chunks, slot_ids);
}

// Layer `layer` of hidden-state slots -> out (device): one H2D run per slot, merged where slots
// and rows are consecutive on both sides (they are not for layer blocks of consecutive slots).
// One cudaMemcpy2DAsync per run of consecutive slots (slot stride as the source pitch) was tried
// and removed: 1.08 against 0.23 ms of host time for 8 calls, slower pipelined (H100, run CN).
void onload_hidden_cuda(at::Tensor out, const at::Tensor& hidden_arena, const at::Tensor& slot_ids, int64_t layer) {
  TORCH_CHECK(out.is_cuda() && hidden_arena.is_cpu() && slot_ids.is_cpu(),
              "onload_hidden on CUDA takes out on the GPU and hidden_arena, slot_ids on the CPU, got ", out.device(),
              ", ", hidden_arena.device(), ", ", slot_ids.device());
  check_onload_hidden(out, hidden_arena, slot_ids, layer);
  const int64_t n = slot_ids.size(0);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t es = hidden_arena.element_size();
  const int64_t block_bytes = hidden_arena.size(2) * hidden_arena.size(3) * es;
  const char* arena = static_cast<const char*>(hidden_arena.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int32_t* slots = slot_ids.data_ptr<int32_t>();
  std::vector<CopyRun> runs;
  runs.reserve(static_cast<size_t>(n));
  for (int64_t c = 0; c < n; ++c) {
    const char* src = arena + (static_cast<int64_t>(slots[c]) * hidden_arena.stride(0) + layer * hidden_arena.stride(1)) * es;
    add_run(runs, dst + c * block_bytes, src, static_cast<size_t>(block_bytes));
  }
  enqueue_runs(runs, cudaMemcpyHostToDevice, hidden_arena.is_pinned(), at::cuda::getCurrentCUDAStream());
}

// Hidden-state chunks (device) -> host slots, each slot's [L, chunk_tokens, D] block.
void store_hidden_chunks_cuda(at::Tensor hidden_arena, const at::Tensor& chunks, const at::Tensor& slot_ids) {
  TORCH_CHECK(chunks.is_cuda() && hidden_arena.is_cpu() && slot_ids.is_cpu(),
              "store_hidden_chunks on CUDA takes chunks on the GPU and hidden_arena, slot_ids on the CPU, got ",
              chunks.device(), ", ", hidden_arena.device(), ", ", slot_ids.device());
  check_store_hidden(hidden_arena, chunks, slot_ids);
  const int64_t es = hidden_arena.element_size();
  store_chunks_in_slots(hidden_arena, hidden_arena.stride(0) * es, hidden_arena.size(1) * hidden_arena.stride(1) * es,
                        chunks, slot_ids);
}

// write_pinned, read_pinned: the whole byte range is one item, spread over the grid by copy_items.
struct LinearAddr {
  const char* from;
  char* to;
  __device__ bool skip(int64_t) const { return false; }
  __device__ const char* src(int64_t) const { return from; }
  __device__ char* dst(int64_t) const { return to; }
};

// write_pinned, read_pinned: the bytes of `device` (a GPU tensor) into (to_host) or out of the
// pinned host tensor `host` (`host_name` in the messages), by copy_items through host's mapped
// address on the current stream. The host allocator is told the stream, so host's block is not
// handed out again before the kernel completed.
void copy_mapped(const char* op, const at::Tensor& host, const char* host_name, const at::Tensor& device,
                 bool to_host) {
  TORCH_CHECK(host.is_pinned(), op, " needs ", host_name, " in pinned memory (pin_memory=True)");
  const int64_t bytes = device.numel() * device.element_size();
  if (bytes == 0) return;
  const c10::cuda::CUDAGuard guard(device.device());
  char* mapped = static_cast<char*>(mapped_address(op, host, host_name));
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto& storage = host.storage().data_ptr();
  at::getHostAllocator(at::kCUDA)->record_event(storage.get(), storage.get_context(), stream.unwrap());
  char* on_device = static_cast<char*>(device.data_ptr());
  const LinearAddr addr = to_host ? LinearAddr{on_device, mapped} : LinearAddr{mapped, on_device};
  const int vec = vector_bytes({addr_of(addr.from), addr_of(addr.to), static_cast<uint64_t>(bytes)});
  copy_items(addr, 1, bytes, vec, stream);
}

void write_pinned_cuda(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK(src.is_cuda() && dst.is_cpu(), "write_pinned on CUDA takes src on the GPU and dst on the CPU, got ",
              src.device(), ", ", dst.device());
  check_pinned_copy(dst, src);
  copy_mapped("write_pinned", dst, "dst", src, /*to_host=*/true);
}

void read_pinned_cuda(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK(dst.is_cuda() && src.is_cpu(), "read_pinned on CUDA takes dst on the GPU and src on the CPU, got ",
              dst.device(), ", ", src.device());
  check_pinned_copy(dst, src);
  copy_mapped("read_pinned", src, "src", dst, /*to_host=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(hstu, CUDA, m) {
  m.impl("append_kvcache", &append_kvcache_cuda);
  m.impl("gather_kvcache", &gather_kvcache_cuda);
  m.impl("gather_kvcache_all_layers", &gather_kvcache_all_layers_cuda);
  m.impl("onload_kvcache", &onload_kvcache_cuda);
  m.impl("store_host_chunks", &store_host_chunks_cuda);
  m.impl("onload_hidden", &onload_hidden_cuda);
  m.impl("store_hidden_chunks", &store_hidden_chunks_cuda);
  m.impl("write_pinned", &write_pinned_cuda);
  m.impl("read_pinned", &read_pinned_cuda);
}

}  // namespace hstu
