// Fills one batch's packed KV-cache metadata (ops/kvcache/metadata.py) in one C++ pass: the prepare
// worker did it with ~30 numpy calls over the batch's rows and pages, each of which dropped and
// re-took the GIL on large batches, queueing behind the model thread and the process's other threads.
//
// The Python side owns the layout: it picks the shapes (padded to a CUDA-graph bucket or not) and
// the 16-byte-aligned byte offset of each field in `buffer` (uint8, CPU), in this order:
//   0 page_table [nB, nP] i32     1 page_indices [nB*nP padded | pages] i32   2 page_indptr [nB+1] i32
//   3 last_page_len [nB] i32      4 kv_lens [nB] i32      5 cached_lens [nB] i32   6 q_offsets [nB+1] i32
//   7 q_batch [nT] i64            8 q_local [nT] i64      9 q_pos [nT] i64        10 append_rows [nTn] i64
//  11 append_page_ids [nTn] i32  12 append_offsets [nTn] i32
// Rows follow JaggedLayout: per user, its new history tokens (positions cached .. history - 1) then
// its candidates. Past the batch's own entries each field holds its padding (metadata.py's _PADDING):
// the scratch page (page_table, page_indices, append_page_ids), the last offset (page_indptr,
// q_offsets), the row index (q_local), -1 (q_pos), 1 (last_page_len), else 0. Unpadded, page_table's
// row b is padded with user b's first page instead. The GIL stays held (microseconds of work).
// Page lists arrive as int32 arrays (GpuPageManager.reserve_arrays; lists are converted): a batch
// of 8 users over 4k-token histories has ~2,000 pages, and converting them as Python ints cost more
// (~35 us on the dev CPU) than packing every field.
#include <torch/extension.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "kv_checks.h"

#include <algorithm>
#include <string>
#include <vector>

namespace py = pybind11;

namespace hstu {
namespace {

constexpr int kFields = 13;
using PageList = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

template <typename T>
void fill_tail(T* dest, int64_t from, int64_t size, T value) {
  std::fill(dest + std::min(from, size), dest + size, value);
}

void pack_metadata(torch::Tensor buffer, const std::vector<int64_t>& offsets,
                   const std::vector<PageList>& page_lists, const std::vector<int64_t>& history_lens,
                   const std::vector<int64_t>& cached_lens, const std::vector<int64_t>& num_candidates,
                   int64_t page_size, int64_t nB, int64_t nP, int64_t nT, int64_t nTn, bool padded,
                   int64_t scratch) {
  const int64_t B = page_lists.size();
  require(history_lens.size() == size_t(B) && cached_lens.size() == size_t(B) && num_candidates.size() == size_t(B),
          "pack_metadata: " + std::to_string(B) + " page lists need as many history, cached and candidate counts");
  require(offsets.size() == kFields, "pack_metadata: need " + std::to_string(kFields) + " field offsets");
  require(buffer.device().is_cpu() && buffer.scalar_type() == torch::kByte && buffer.is_contiguous(),
          "pack_metadata: buffer must be a contiguous uint8 CPU tensor");
  require(page_size > 0 && B <= nB, "pack_metadata: bad page size or batch over its padded size");
  int64_t T = 0, Tn = 0, pages = 0;
  for (int64_t b = 0; b < B; ++b) {
    require(page_lists[b].ndim() == 1, "pack_metadata: user " + std::to_string(b) + "'s page list is not 1-D");
    const int64_t h = history_lens[b], c = cached_lens[b], n = page_lists[b].size();
    require(0 <= c && c <= h, "pack_metadata: user " + std::to_string(b) + " cached length " + std::to_string(c) +
                                  " outside [0, " + std::to_string(h) + "]");
    require(n == (h + page_size - 1) / page_size, "pack_metadata: user " + std::to_string(b) + ": " +
                                                      std::to_string(n) + " pages cannot hold exactly " +
                                                      std::to_string(h) + " tokens");
    require(n <= nP, "pack_metadata: user " + std::to_string(b) + " has " + std::to_string(n) +
                         " pages; the table holds " + std::to_string(nP));
    T += h - c + num_candidates[b];
    Tn += h - c;
    pages += n;
  }
  require(T <= nT && Tn <= nTn, "pack_metadata: " + std::to_string(T) + " rows do not fit " + std::to_string(nT));
  const int64_t nPages = padded ? nB * nP : pages;
  const int64_t sizes[kFields] = {nB * nP * 4, nPages * 4, (nB + 1) * 4, nB * 4, nB * 4, nB * 4, (nB + 1) * 4,
                                  nT * 8,      nT * 8,     nT * 8,       nTn * 8, nTn * 4, nTn * 4};
  for (int f = 0; f < kFields; ++f) {
    require(offsets[f] >= 0 && offsets[f] + sizes[f] <= buffer.numel(),
            "pack_metadata: field " + std::to_string(f) + " does not fit the buffer of " +
                std::to_string(buffer.numel()) + " bytes");
  }
  uint8_t* base = buffer.data_ptr<uint8_t>();
  const auto i32 = [&](int f) { return reinterpret_cast<int32_t*>(base + offsets[f]); };
  const auto i64 = [&](int f) { return reinterpret_cast<int64_t*>(base + offsets[f]); };
  int32_t *table = i32(0), *indices = i32(1), *indptr = i32(2), *last_len = i32(3), *kv_lens = i32(4),
          *cached = i32(5), *q_offsets = i32(6), *append_pages = i32(11), *append_offsets = i32(12);
  int64_t *q_batch = i64(7), *q_local = i64(8), *q_pos = i64(9), *append_rows = i64(10);

  int64_t page_at = 0, row = 0, appended = 0;
  indptr[0] = 0;
  q_offsets[0] = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* list = page_lists[b].data();
    const int64_t n = page_lists[b].size(), h = history_lens[b], c = cached_lens[b];
    int32_t* table_row = table + b * nP;
    for (int64_t j = 0; j < nP; ++j) {
      table_row[j] = j < n ? int32_t(list[j]) : int32_t(padded || n == 0 ? scratch : list[0]);
    }
    for (int64_t j = 0; j < n; ++j) indices[page_at + j] = int32_t(list[j]);
    page_at += n;
    indptr[b + 1] = int32_t(page_at);
    last_len[b] = int32_t(h - (n - 1) * page_size);
    kv_lens[b] = int32_t(h);
    cached[b] = int32_t(c);
    const int64_t rows = h - c + num_candidates[b];
    for (int64_t local = 0; local < rows; ++local, ++row) {
      q_batch[row] = b;
      q_local[row] = local;
      const bool history = local < h - c;
      const int64_t pos = history ? c + local : -1;
      q_pos[row] = pos;
      if (history) {
        append_rows[appended] = row;
        append_pages[appended] = int32_t(list[pos / page_size]);
        append_offsets[appended] = int32_t(pos % page_size);
        ++appended;
      }
    }
    q_offsets[b + 1] = int32_t(row);
  }
  // Padding past the batch's own entries (none when unpadded: every size is exact).
  for (int64_t b = B; b < nB; ++b) std::fill(table + b * nP, table + (b + 1) * nP, int32_t(scratch));
  fill_tail(indices, pages, nPages, int32_t(scratch));
  fill_tail(indptr, B + 1, nB + 1, int32_t(page_at));
  fill_tail(last_len, B, nB, int32_t(1));
  fill_tail(kv_lens, B, nB, int32_t(0));
  fill_tail(cached, B, nB, int32_t(0));
  fill_tail(q_offsets, B + 1, nB + 1, int32_t(row));
  fill_tail(q_batch, T, nT, int64_t(0));
  for (int64_t r = T; r < nT; ++r) q_local[r] = r;
  fill_tail(q_pos, T, nT, int64_t(-1));
  fill_tail(append_rows, Tn, nTn, int64_t(0));
  fill_tail(append_pages, Tn, nTn, int32_t(scratch));
  fill_tail(append_offsets, Tn, nTn, int32_t(0));
}

}  // namespace

void bind_pack_metadata(py::module& m) {
  m.def("pack_metadata", &pack_metadata, py::arg("buffer"), py::arg("offsets"), py::arg("page_lists"),
        py::arg("history_lens"), py::arg("cached_lens"), py::arg("num_candidates"), py::arg("page_size"),
        py::arg("num_users"), py::arg("max_pages"), py::arg("rows"), py::arg("append_rows"), py::arg("padded"),
        py::arg("scratch_page"),
        "Writes the batch's 13 metadata fields at their byte offsets in `buffer` (see "
        "csrc/pack_metadata.cpp); ValueError naming the user or field that does not fit.");
}

}  // namespace hstu
