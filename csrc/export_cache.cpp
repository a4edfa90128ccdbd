// ExportKVCache: the tiered KV cache as a TorchScript custom class (an opaque handle), and the
// cache-protocol ops that take it, so a forward calling them can be captured by torch.export and
// run by AOTInductor from C++ without Python (ops/cache_ops.py has the fakes, engine/exported.py
// the forward).
//
// The object owns the page tensor kv [num_layers, num_pages, 2, page_size, H, d] with a
// GpuPageManager (page pool, user LRU, pins), and a host arena [host_slots, num_layers,
// pages_per_chunk, 2, page_size, H, d] with a HostStorage (chunk slots, user LRU); host_slots 0
// means no host tier. A cached prefix is identified exactly by its token records ([n, 2] int64,
// model/identity.py's layout), stored as the entry's digest bytes: a lookup reuses cached K/V
// only when the request's first `cached` records equal them byte for byte. The model is fixed by
// the program the cache is embedded in (its weights are constants).
//
// One forward, in this order (torch.export orders ops on one object through effect tokens):
//   cache_lookup   cached length per user: the GPU entry, else the host chunks; a shorter or
//                  diverging history drops the user from both tiers (GPU) or the host tier
//   cache_allocate pins users, reserves pages (evicting LRU unpinned users), copies host-tier
//                  users' chunks into their first pages (onload, synchronous), returns the
//                  batch's row layout and page metadata
//   per layer: cache_append (new history tokens' K/V into their slots), cache_gather (each
//                  user's padded K/V, a fresh tensor, after the append)
//   cache_commit   valid lengths and identities of the whole histories; copies each user's newly
//                  full chunks (all layers) into host slots (offload, synchronous; skipped for a
//                  user when the host tier has no room); unpins
// A forward that failed before cache_commit leaves its users pinned; the next cache_lookup
// releases and drops them (their pages may hold partial writes).
//
// Pickling (AOTInductor packages the object) keeps the configuration only: a loaded package
// starts with an empty cache. Every op runs on the host for the bookkeeping and ATen for the
// copies, so one impl serves CPU and CUDA tensors.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "cache/gpu_page_manager.h"
#include "cache/host_storage.h"

namespace hstu {
namespace {

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw std::invalid_argument("ExportKVCache: dtype must be float32, bfloat16 or float16, got " + name);
}

// A CPU int64 contiguous copy of an index tensor, for the host bookkeeping.
at::Tensor host_long(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, "ExportKVCache: ", name, " must be ", dim, "-D, got shape ", t.sizes());
  return t.to(at::kCPU, at::kLong).contiguous();
}

// An int64 tensor of ids or lengths (built on the host, then moved).
template <typename Ids>
at::Tensor long_tensor(const Ids& values, const at::Device& device = at::kCPU) {
  std::vector<int64_t> longs(values.begin(), values.end());
  return at::tensor(longs, at::TensorOptions().dtype(at::kLong)).to(device);
}

constexpr size_t kRecordBytes = 2 * sizeof(int64_t);

// True when the stored identity is exactly the first `len` of a history's `n` records.
bool same_prefix(const std::string& identity, const char* records, int64_t len, int64_t n) {
  const size_t bytes = static_cast<size_t>(len) * kRecordBytes;
  return len <= n && identity.size() == bytes && std::memcmp(identity.data(), records, bytes) == 0;
}

}  // namespace

class ExportKVCache : public torch::CustomClassHolder {
 public:
  using State =
      std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, std::string, std::string>;

  ExportKVCache(int64_t num_layers, int64_t num_pages, int64_t page_size, int64_t num_heads, int64_t head_dim,
                int64_t host_slots, int64_t chunk_tokens, std::string dtype, std::string device)
      : state_(num_layers, num_pages, page_size, num_heads, head_dim, host_slots, chunk_tokens, dtype, device),
        gpu_(num_pages, page_size),
        host_(host_slots, chunk_tokens) {
    TORCH_CHECK(num_layers > 0 && num_heads > 0 && head_dim > 0, "ExportKVCache: num_layers ", num_layers,
                ", num_heads ", num_heads, ", head_dim ", head_dim, " must be positive");
    TORCH_CHECK(chunk_tokens % page_size == 0, "ExportKVCache: chunk_tokens ", chunk_tokens,
                " must be a multiple of page_size ", page_size);
    const auto options = at::TensorOptions().dtype(parse_dtype(dtype));
    const at::Device dev(device);
    kv_ = at::zeros({num_layers, num_pages, 2, page_size, num_heads, head_dim}, options.device(dev));
    pages_per_chunk_ = chunk_tokens / page_size;
    host_arena_ = at::zeros({host_slots, num_layers, pages_per_chunk_, 2, page_size, num_heads, head_dim},
                            options.pinned_memory(dev.is_cuda()));
  }

  const State& state() const { return state_; }

  // Cached length of each user's history [B] (records [N, 2] of all users, CSR record_offsets [B+1]).
  at::Tensor lookup(const at::Tensor& user_ids, const at::Tensor& records, const at::Tensor& record_offsets) {
    std::lock_guard<std::mutex> lock(mu_);
    abort_pending_locked();
    onload_.clear();
    const auto users = host_long(user_ids, "user_ids", 1);
    const auto recs = host_long(records, "records", 2);
    const auto offs = host_long(record_offsets, "record_offsets", 1);
    const int64_t B = users.size(0);
    TORCH_CHECK(offs.size(0) == B + 1, "ExportKVCache: record_offsets has ", offs.size(0), " entries for ", B,
                " users");
    const int64_t* u = users.data_ptr<int64_t>();
    const int64_t* o = offs.data_ptr<int64_t>();
    const char* bytes = reinterpret_cast<const char*>(recs.data_ptr<int64_t>());
    std::vector<int64_t> cached(B, 0);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = o[b + 1] - o[b];
      const char* history = bytes + o[b] * kRecordBytes;
      auto [len, identity] = gpu_.lookup(u[b]);
      if (len > 0) {
        if (same_prefix(identity, history, len, n)) {
          cached[b] = len;
          reused_tokens_ += len;
        } else {  // the host chunks are a prefix of the GPU entry's history: drop both
          gpu_.invalidate(u[b]);
          host_.invalidate(u[b]);
          ++invalidations_;
        }
        continue;
      }
      auto [slots, host_identity] = host_.lookup(u[b]);
      const int64_t host_len = static_cast<int64_t>(slots.size()) * host_.chunk_tokens();
      if (host_len == 0) continue;
      if (same_prefix(host_identity, history, host_len, n)) {
        cached[b] = host_len;
        reused_tokens_ += host_len;
        onloaded_tokens_ += host_len;
        host_.touch(u[b]);
        onload_[u[b]] = std::move(slots);
      } else {
        host_.invalidate(u[b]);
        ++invalidations_;
      }
    }
    return long_tensor(cached, user_ids.device());
  }

  // Pins the users, reserves pages for their whole histories (evicting LRU unpinned users) and
  // copies host-tier hits' chunks into their first pages; returns the batch's layout:
  // rows [T] (column of each row in the forward's feature array: history token p of user b is
  // record_offsets[b] + p, candidate j is N + candidate_offsets[b] + j), q_batch, q_local, q_pos [T]
  // (-1 for candidates), append_rows, append_page_ids, append_offsets [Tn], page_table [B, max_pages]
  // (padded with the user's first page), kv_lens [B], max_q (0-dim, on the host). Per user its new
  // history rows come first, then its candidates.
  std::vector<at::Tensor> allocate(const at::Tensor& user_ids, const at::Tensor& cached_lens,
                                   const at::Tensor& record_offsets, const at::Tensor& candidate_offsets) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto users_t = host_long(user_ids, "user_ids", 1);
    const auto cached_t = host_long(cached_lens, "cached_lens", 1);
    const auto offs_t = host_long(record_offsets, "record_offsets", 1);
    const auto cand_t = host_long(candidate_offsets, "candidate_offsets", 1);
    const int64_t B = users_t.size(0);
    TORCH_CHECK(cached_t.size(0) == B && offs_t.size(0) == B + 1 && cand_t.size(0) == B + 1,
                "ExportKVCache: ", B, " users need ", B, " cached lengths and ", B + 1, " offsets, got ",
                cached_t.size(0), ", ", offs_t.size(0), ", ", cand_t.size(0));
    const int64_t* o = offs_t.data_ptr<int64_t>();
    const int64_t* co = cand_t.data_ptr<int64_t>();
    std::vector<int64_t> users(users_t.data_ptr<int64_t>(), users_t.data_ptr<int64_t>() + B);
    std::vector<int64_t> keep(cached_t.data_ptr<int64_t>(), cached_t.data_ptr<int64_t>() + B);
    std::vector<int64_t> cached = keep;
    std::vector<int64_t> hist(B);
    for (int64_t b = 0; b < B; ++b) {
      if (onload_.count(users[b])) keep[b] = 0;  // not on the GPU: its pages are filled by onload
      hist[b] = o[b + 1] - o[b];
      if (hist[b] <= 0) {
        throw std::invalid_argument("ExportKVCache: user " + std::to_string(users[b]) +
                                    ": history length must be positive, got " + std::to_string(hist[b]));
      }
    }
    const auto pages = gpu_.reserve(users, keep, hist);
    gpu_.take_evicted();
    pending_ = users;
    onload_locked(users, pages);

    const int64_t ps = gpu_.page_size();
    const int64_t N = o[B];
    std::vector<int64_t> rows, q_batch, q_local, q_pos, append_rows, append_pages, append_offsets, kv_lens;
    size_t max_pages = 1;
    int64_t max_q = 0;
    for (int64_t b = 0; b < B; ++b) {
      max_pages = std::max(max_pages, pages[b].size());
      int64_t local = 0;
      for (int64_t p = cached[b]; p < hist[b]; ++p, ++local) {
        append_rows.push_back(static_cast<int64_t>(rows.size()));
        append_pages.push_back(pages[b][p / ps]);
        append_offsets.push_back(p % ps);
        rows.push_back(o[b] + p);
        q_batch.push_back(b);
        q_local.push_back(local);
        q_pos.push_back(p);
      }
      for (int64_t j = co[b]; j < co[b + 1]; ++j, ++local) {
        rows.push_back(N + j);
        q_batch.push_back(b);
        q_local.push_back(local);
        q_pos.push_back(-1);
      }
      max_q = std::max(max_q, local);
      kv_lens.push_back(hist[b]);
    }
    std::vector<int64_t> table(B * max_pages);
    for (int64_t b = 0; b < B; ++b) {
      for (size_t i = 0; i < max_pages; ++i) table[b * max_pages + i] = pages[b][i < pages[b].size() ? i : 0];
    }
    const auto device = kv_.device();
    return {long_tensor(rows, device),
            long_tensor(q_batch, device),
            long_tensor(q_local, device),
            long_tensor(q_pos, device),
            long_tensor(append_rows, device),
            long_tensor(append_pages, device),
            long_tensor(append_offsets, device),
            long_tensor(table, device).view({B, static_cast<int64_t>(max_pages)}),
            long_tensor(kv_lens, device),
            at::scalar_tensor(max_q, at::TensorOptions().dtype(at::kLong))};
  }

  // Writes new tokens' K/V [Tn, H, d] of `layer` into slots (page_ids[t], offsets[t]).
  void append(int64_t layer, const at::Tensor& k, const at::Tensor& v, const at::Tensor& page_ids,
              const at::Tensor& offsets) {
    check_layer(layer);
    TORCH_CHECK(k.sizes() == v.sizes() && k.dim() == 3 && k.size(0) == page_ids.size(0) &&
                    page_ids.sizes() == offsets.sizes(),
                "ExportKVCache.append: k ", k.sizes(), ", v ", v.sizes(), ", page_ids ", page_ids.sizes(),
                ", offsets ", offsets.sizes(), " do not match");
    if (k.size(0) == 0) return;
    auto layer_kv = kv_.select(0, layer);
    const auto pages = page_ids.to(kv_.device(), at::kLong);
    const auto slots = offsets.to(kv_.device(), at::kLong);
    layer_kv.select(1, 0).index_put_({pages, slots}, k.to(kv_.scalar_type()));
    layer_kv.select(1, 1).index_put_({pages, slots}, v.to(kv_.scalar_type()));
  }

  // Each user's pages of `layer` as padded keys and values [B, max_pages * page_size, H, d] (copies).
  std::tuple<at::Tensor, at::Tensor> gather(int64_t layer, const at::Tensor& page_table) const {
    check_layer(layer);
    TORCH_CHECK(page_table.dim() == 2, "ExportKVCache.gather: page_table must be 2-D, got ", page_table.sizes());
    const int64_t B = page_table.size(0), P = page_table.size(1);
    const auto pages = kv_.select(0, layer).index_select(0, page_table.reshape({-1}).to(kv_.device(), at::kLong));
    const auto paged = pages.view({B, P, 2, kv_.size(3), kv_.size(4), kv_.size(5)});
    const auto shape = std::vector<int64_t>{B, P * kv_.size(3), kv_.size(4), kv_.size(5)};
    return {paged.select(2, 0).reshape(shape).contiguous(), paged.select(2, 1).reshape(shape).contiguous()};
  }

  // Commits each user's whole history (length and records) and unpins the batch.
  void commit(const at::Tensor& user_ids, const at::Tensor& records, const at::Tensor& record_offsets) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto users = host_long(user_ids, "user_ids", 1);
    const auto recs = host_long(records, "records", 2);
    const auto offs = host_long(record_offsets, "record_offsets", 1);
    const int64_t B = users.size(0);
    const int64_t* u = users.data_ptr<int64_t>();
    const int64_t* o = offs.data_ptr<int64_t>();
    std::vector<int64_t> batch(u, u + B);
    TORCH_CHECK(batch == pending_, "ExportKVCache.commit: users differ from the allocated batch");
    const char* bytes = reinterpret_cast<const char*>(recs.data_ptr<int64_t>());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = o[b + 1] - o[b];
      const char* history = bytes + o[b] * kRecordBytes;
      gpu_.commit(u[b], n, std::string(history, n * kRecordBytes));
      offload_locked(u[b], n, history);
    }
    gpu_.release(batch);
    pending_.clear();
  }

  int64_t num_users() const { return gpu_.num_users(); }
  int64_t num_free_pages() const { return gpu_.num_free_pages(); }
  int64_t evictions() const { return gpu_.evictions(); }
  int64_t invalidations() const { return invalidations_; }
  int64_t reused_tokens() const { return reused_tokens_; }
  int64_t onloaded_tokens() const { return onloaded_tokens_; }
  int64_t offloaded_chunks() const { return offloaded_chunks_; }
  int64_t host_users() const { return host_.num_users(); }

 private:
  void check_layer(int64_t layer) const {
    TORCH_CHECK(layer >= 0 && layer < kv_.size(0), "ExportKVCache: layer ", layer, " outside [0, ", kv_.size(0), ")");
  }

  // Host chunks of this batch's host-tier users -> their first pages, every layer.
  void onload_locked(const std::vector<int64_t>& users, const std::vector<std::vector<int32_t>>& pages) {
    std::vector<int64_t> slots, targets;
    for (size_t b = 0; b < users.size(); ++b) {
      auto it = onload_.find(users[b]);
      if (it == onload_.end()) continue;
      slots.insert(slots.end(), it->second.begin(), it->second.end());
      targets.insert(targets.end(), pages[b].begin(), pages[b].begin() + it->second.size() * pages_per_chunk_);
    }
    onload_.clear();
    if (slots.empty()) return;
    auto chunks = host_arena_.index_select(0, long_tensor(slots)).transpose(0, 1);  // [L, n, ppc, 2, ps, H, d]
    chunks = chunks.reshape({kv_.size(0), -1, 2, kv_.size(3), kv_.size(4), kv_.size(5)});
    kv_.index_copy_(1, long_tensor(targets, kv_.device()), chunks.to(kv_.device()));
  }

  // The user's newly full chunks (after those the host tier holds), every layer -> host slots.
  void offload_locked(int64_t user, int64_t n, const char* history) {
    const int64_t chunk = host_.chunk_tokens();
    const int64_t full = n / chunk;
    const auto held = static_cast<int64_t>(host_.lookup(user).first.size());
    if (host_.num_slots() == 0 || full <= held) return;
    std::vector<int32_t> slots;
    try {
      slots = host_.reserve(user, held, full - held);
    } catch (const CacheCapacityError&) {
      return;  // every slot is reserved or owned by this user: it stays GPU-only
    }
    host_.take_evicted();
    const auto user_pages = gpu_.pages(user);
    const std::vector<int32_t> pages(user_pages.begin() + held * pages_per_chunk_,
                                     user_pages.begin() + full * pages_per_chunk_);
    auto chunks = kv_.index_select(1, long_tensor(pages, kv_.device()));  // [L, k*ppc, 2, ps, H, d]
    chunks = chunks.view({kv_.size(0), full - held, pages_per_chunk_, 2, kv_.size(3), kv_.size(4), kv_.size(5)});
    host_arena_.index_copy_(0, long_tensor(slots), chunks.transpose(0, 1).to(at::kCPU));
    if (host_.commit(user, slots, held, std::string(history, full * chunk * kRecordBytes))) {
      offloaded_chunks_ += full - held;
    }
  }

  void abort_pending_locked() {
    if (pending_.empty()) return;
    gpu_.release(pending_);
    for (int64_t u : pending_) gpu_.invalidate(u);
    pending_.clear();
  }

  State state_;
  GpuPageManager gpu_;
  HostStorage host_;
  at::Tensor kv_;
  at::Tensor host_arena_;
  int64_t pages_per_chunk_ = 1;
  std::mutex mu_;
  std::vector<int64_t> pending_;  // users pinned by allocate, not yet committed
  std::unordered_map<int64_t, std::vector<int32_t>> onload_;  // host-tier hits of the last lookup
  int64_t invalidations_ = 0;  // entries dropped by lookup (shorter or diverging history)
  int64_t reused_tokens_ = 0;  // cached tokens lookup handed out (either tier), cumulative
  int64_t onloaded_tokens_ = 0;  // of those, tokens copied from the host tier
  int64_t offloaded_chunks_ = 0;  // chunks committed to the host tier
};

namespace {

using CacheRef = c10::intrusive_ptr<ExportKVCache>;

at::Tensor cache_lookup(const CacheRef& cache, const at::Tensor& user_ids, const at::Tensor& records,
                        const at::Tensor& record_offsets) {
  return cache->lookup(user_ids, records, record_offsets);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor>
cache_allocate(const CacheRef& cache, const at::Tensor& user_ids, const at::Tensor& cached_lens,
               const at::Tensor& record_offsets, const at::Tensor& candidate_offsets) {
  auto o = cache->allocate(user_ids, cached_lens, record_offsets, candidate_offsets);
  return {o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8], o[9]};
}

void cache_append(const CacheRef& cache, int64_t layer, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& page_ids, const at::Tensor& offsets) {
  cache->append(layer, k, v, page_ids, offsets);
}

std::tuple<at::Tensor, at::Tensor> cache_gather(const CacheRef& cache, int64_t layer, const at::Tensor& page_table) {
  return cache->gather(layer, page_table);
}

void cache_commit(const CacheRef& cache, const at::Tensor& user_ids, const at::Tensor& records,
                  const at::Tensor& record_offsets) {
  cache->commit(user_ids, records, record_offsets);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hstu, m) {
  m.class_<ExportKVCache>("ExportKVCache")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, std::string, std::string>())
      .def("num_users", &ExportKVCache::num_users)
      .def("num_free_pages", &ExportKVCache::num_free_pages)
      .def("evictions", &ExportKVCache::evictions)
      .def("invalidations", &ExportKVCache::invalidations)
      .def("reused_tokens", &ExportKVCache::reused_tokens)
      .def("onloaded_tokens", &ExportKVCache::onloaded_tokens)
      .def("offloaded_chunks", &ExportKVCache::offloaded_chunks)
      .def("host_users", &ExportKVCache::host_users)
      .def("__obj_flatten__",
           [](const CacheRef& self) {
             const auto& [layers, pages, ps, heads, dim, slots, chunk, dtype, device] = self->state();
             return std::make_tuple(std::make_tuple(std::string("num_layers"), layers),
                                    std::make_tuple(std::string("num_pages"), pages),
                                    std::make_tuple(std::string("page_size"), ps),
                                    std::make_tuple(std::string("num_heads"), heads),
                                    std::make_tuple(std::string("head_dim"), dim),
                                    std::make_tuple(std::string("host_slots"), slots),
                                    std::make_tuple(std::string("chunk_tokens"), chunk),
                                    std::make_tuple(std::string("dtype"), dtype),
                                    std::make_tuple(std::string("device"), device));
           })
      .def_pickle([](const CacheRef& self) { return self->state(); },
                  [](ExportKVCache::State s) {
                    return std::apply(
                        [](auto... args) { return c10::make_intrusive<ExportKVCache>(args...); }, std::move(s));
                  });

#define HSTU_CACHE_ARG "__torch__.torch.classes.hstu.ExportKVCache cache"
  m.def("cache_lookup(" HSTU_CACHE_ARG ", Tensor user_ids, Tensor records, Tensor record_offsets) -> Tensor");
  m.def("cache_allocate(" HSTU_CACHE_ARG
        ", Tensor user_ids, Tensor cached_lens, Tensor record_offsets, Tensor candidate_offsets) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("cache_append(" HSTU_CACHE_ARG ", int layer, Tensor k, Tensor v, Tensor page_ids, Tensor offsets) -> ()");
  m.def("cache_gather(" HSTU_CACHE_ARG ", int layer, Tensor page_table) -> (Tensor, Tensor)");
  m.def("cache_commit(" HSTU_CACHE_ARG ", Tensor user_ids, Tensor records, Tensor record_offsets) -> ()");
#undef HSTU_CACHE_ARG
}

TORCH_LIBRARY_IMPL(hstu, CompositeExplicitAutograd, m) {
  m.impl("cache_lookup", &cache_lookup);
  m.impl("cache_allocate", &cache_allocate);
  m.impl("cache_append", &cache_append);
  m.impl("cache_gather", &cache_gather);
  m.impl("cache_commit", &cache_commit);
}

}  // namespace hstu
