// pybind11 bindings of the cache bookkeeping backends (GpuPageManager, HostStorage) and of the
// batch's host inputs (batch_features.cpp, pack_metadata.cpp), request checks (request_checks.cpp) and
// the planner's split search (split_planner.cpp).
//
// Python view: user ids and lengths are int, digests are bytes (b"" = none), page/slot lists are
// list[int] (GpuPageManager.reserve_arrays: int32 numpy arrays). C++ errors map to Python as: CacheCapacityError -> ext.CacheCapacityError (a
// RuntimeError), std::invalid_argument -> ValueError, std::logic_error -> RuntimeError (pybind11's
// std::exception fallback). The classes lock internally, and no call releases the GIL: each takes
// microseconds (a reserve that evicts frees a few page lists), and a release makes the calling
// thread (the model thread or a cache worker) queue for the GIL again behind every other busy thread
// of the process, up to the interpreter's switch interval each time (a GIL convoy; the engine
// process's GIL is saturated). No C++ path takes the GIL while holding an index's lock.
// The torch op schemas live in ops.cpp (TORCH_LIBRARY(hstu, ...)), a separate translation unit.
#include <torch/extension.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>

#include "cache/gpu_page_manager.h"
#include "cache/host_storage.h"

namespace py = pybind11;
using hstu::GpuPageManager;
using hstu::HostStorage;

namespace hstu {
void bind_batch_features(py::module& m);  // batch_features.cpp
void bind_pack_metadata(py::module& m);   // pack_metadata.cpp
void bind_request_checks(py::module& m);  // request_checks.cpp
void bind_response_json(py::module& m);   // response_json.cpp
void bind_split_planner(py::module& m);   // split_planner.cpp
}

namespace {
// reserve() with each page list as an int32 numpy array (one copy) instead of a list of Python
// ints: the manager hands them to pack_metadata and slices them, never iterates them in Python.
py::list reserve_arrays(GpuPageManager& gpu, const std::vector<int64_t>& users, const std::vector<int64_t>& keep_lens,
                        const std::vector<int64_t>& target_lens) {
  const auto lists = gpu.reserve(users, keep_lens, target_lens);
  py::list out(lists.size());
  for (size_t i = 0; i < lists.size(); ++i) {
    py::array_t<int32_t> pages(static_cast<py::ssize_t>(lists[i].size()));
    std::copy(lists[i].begin(), lists[i].end(), pages.mutable_data());
    out[i] = std::move(pages);
  }
  return out;
}

// lookup() with the digest returned as bytes (pybind11 would decode a std::string as UTF-8 text).
template <typename Index>
py::tuple lookup_as_bytes(const Index& index, int64_t user) {
  auto found = index.lookup(user);
  return py::make_tuple(py::cast(found.first), py::bytes(found.second));
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::register_exception<hstu::CacheCapacityError>(m, "CacheCapacityError", PyExc_RuntimeError);
  hstu::bind_batch_features(m);
  hstu::bind_pack_metadata(m);
  hstu::bind_request_checks(m);
  hstu::bind_response_json(m);
  hstu::bind_split_planner(m);

  py::class_<GpuPageManager>(m, "GpuPageManager",
                             "GPU KV page pool bookkeeping: per-user page lists, user LRU, pinning.")
      .def(py::init<int64_t, int64_t>(), py::arg("num_pages"), py::arg("page_size"))
      .def("lookup", &lookup_as_bytes<GpuPageManager>, py::arg("user"),
           "(valid length, digest) or (0, b'') if absent; does not change the LRU order.")
      .def("reserve", &GpuPageManager::reserve, py::arg("users"), py::arg("keep_lens"), py::arg("target_lens"),
           "All-or-nothing: keep each user's first keep_len tokens, size its pages to ceil(target_len / "
           "page_size), set length = keep_len, pin, mark MRU; evicts LRU unpinned users outside the call. "
           "Returns list[list[int]] page lists. Raises ValueError, RuntimeError (shrinking a pinned user), "
           "CacheCapacityError.")
      .def("reserve_arrays", &reserve_arrays, py::arg("users"), py::arg("keep_lens"), py::arg("target_lens"),
           "reserve(), each page list an int32 numpy array.")
      .def("commit", &GpuPageManager::commit, py::arg("user"), py::arg("length"), py::arg("digest"),
           "Sets the valid length (<= pages * page_size) and the digest (bytes) of that prefix.")
      .def("release", &GpuPageManager::release, py::arg("users"),
           "Unpins each listed user once; RuntimeError if not pinned (nothing changes then).")
      .def("invalidate", &GpuPageManager::invalidate, py::arg("user"),
           "Drops the user and frees its pages; no-op if absent; RuntimeError if pinned.")
      .def("take_evicted", &GpuPageManager::take_evicted, "Users evicted since the last call, in order.")
      .def("pages", &GpuPageManager::pages, py::arg("user"), "The user's page ids ([] if absent).")
      .def("contains", &GpuPageManager::contains, py::arg("user"))
      .def("pin_count", &GpuPageManager::pin_count, py::arg("user"))
      .def("num_free_pages", &GpuPageManager::num_free_pages)
      .def("num_users", &GpuPageManager::num_users)
      .def("num_pages", &GpuPageManager::num_pages)
      .def("page_size", &GpuPageManager::page_size)
      .def("evictions", &GpuPageManager::evictions)
      .def("allocations", &GpuPageManager::allocations, "Pages handed out by reserve, cumulative.");

  py::class_<HostStorage>(m, "HostStorage",
                          "Host KV arena index: per-user chunk slots, slot allocator, user LRU, pinning.")
      .def(py::init<int64_t, int64_t>(), py::arg("num_slots"), py::arg("chunk_tokens"))
      .def("lookup", &lookup_as_bytes<HostStorage>, py::arg("user"),
           "(slots in chunk order, digest) or ([], b'') if absent; does not change the LRU order.")
      .def("touch", &HostStorage::touch, py::arg("user"), "Marks the user most recently used.")
      .def("reserve", &HostStorage::reserve, py::arg("user"), py::arg("first_chunk"), py::arg("n_chunks"),
           "Reserves n_chunks slots for chunks [first_chunk, first_chunk + n_chunks); first_chunk is the "
           "committed chunk count (append) or 0 (rewrite). Raises ValueError, RuntimeError (rewrite of a "
           "pinned user), CacheCapacityError.")
      .def("commit", &HostStorage::commit, py::arg("user"), py::arg("slots"), py::arg("first_chunk"),
           py::arg("digest"),
           "Makes reserved slots the user's chunks; returns False (slots freed) if that would leave a hole "
           "or rewrite a pinned user.")
      .def("abort", &HostStorage::abort, py::arg("slots"), "Returns reserved slots to the free list.")
      .def("pin", &HostStorage::pin, py::arg("users"), "Pins each user once; ValueError if absent.")
      .def("unpin", &HostStorage::unpin, py::arg("users"),
           "Unpins each user once; RuntimeError if not pinned.")
      .def("invalidate", &HostStorage::invalidate, py::arg("user"),
           "Drops the user and frees its slots; no-op if absent; RuntimeError if pinned.")
      .def("take_evicted", &HostStorage::take_evicted, "Users evicted since the last call, in order.")
      .def("contains", &HostStorage::contains, py::arg("user"))
      .def("pin_count", &HostStorage::pin_count, py::arg("user"))
      .def("num_free_slots", &HostStorage::num_free_slots)
      .def("num_reserved_slots", &HostStorage::num_reserved_slots)
      .def("num_users", &HostStorage::num_users)
      .def("num_slots", &HostStorage::num_slots)
      .def("chunk_tokens", &HostStorage::chunk_tokens)
      .def("evictions", &HostStorage::evictions);
}
