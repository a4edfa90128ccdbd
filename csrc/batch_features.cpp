// Host features of one batch's rows, written straight into the caller's buffer (a CUDA-graph
// bucket's pinned staging, or a fresh tensor): one pass in C++ instead of ~40 numpy calls, each of
// which released and re-took the GIL on large batches (a miss batch has ~16k rows).
//
// Rows follow JaggedLayout (ops/kvcache/layout.py): per user, its history tokens at positions
// cached_len .. history_len - 1, then its candidates. A history of E events is C contextual tokens
// then an item and an action token per event. out is int64 [F, R] (F >= 4, R >= rows), row-major:
//   out[0] table index  contextual value | item_offset + item | action_offset + action | item_offset + candidate
//   out[1] position     the token's position; a candidate's is the history length
//   out[2] time bucket  0 contextual; 1 + min(floor(log2(1 + gap)), nb - 3) for an event's tokens,
//                       gap = its timestamp minus the previous event's (0 for the first); nb - 1 candidates
//   out[3] token type   0 contextual, 1 item, 2 action, 3 candidate (model/batch.py)
//   out[4] (if F >= 5)  the batch's candidate rows, in order (InferenceRankingGR.logits_at)
// and zero past the batch's entries. The GIL stays held: the pass takes microseconds and a release
// would make the model thread queue for the GIL again behind the process's other threads.
#include <torch/extension.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "kv_checks.h"

#include <cmath>
#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace hstu {
namespace {

using Ints = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

enum TokenType : int64_t { kContextual = 0, kItem = 1, kAction = 2, kCandidate = 3 };

int64_t time_bucket(int64_t gap, int64_t num_buckets) {
  // floor(log2(1 + gap)) as the double arithmetic of numpy's log2 path (the tests' per-token definition)
  // gives it. Below 2^40 that is the highest set bit of 1 + gap: there log2(2^k - 1) lies ~1.4 * 2^-k below
  // k, far more than a libm's error of an ulp or two, so no rounding reaches the next integer. Above (gaps
  // of ~35 years in milliseconds) the double path itself. Why not always the double path: std::log2 was
  // most of this pass, ~10 ns a row (a batch-8 front pass has 16k rows, on the critical path of its launch).
  const uint64_t x = 1 + static_cast<uint64_t>(gap);
  const int64_t bucket = gap >= 0 && x < (uint64_t{1} << 40)
                             ? 63 - __builtin_clzll(x)
                             : static_cast<int64_t>(std::floor(std::log2(1.0 + static_cast<double>(gap))));
  return 1 + std::min(bucket, num_buckets - 3);
}

torch::Tensor batch_features(const std::vector<Ints>& item_ids, const std::vector<Ints>& actions,
                             const std::vector<Ints>& timestamps, const std::vector<Ints>& contextual,
                             const std::vector<Ints>& candidates, const std::vector<int64_t>& cached_lens,
                             int64_t num_contextual, int64_t num_time_buckets, int64_t item_offset,
                             int64_t action_offset, std::optional<torch::Tensor> out) {
  const size_t B = item_ids.size();
  require(actions.size() == B && timestamps.size() == B && contextual.size() == B && candidates.size() == B &&
              cached_lens.size() == B,
          "batch_features: every per-user list needs " + std::to_string(B) + " entries");
  require(num_time_buckets >= 3, "batch_features: num_time_buckets must be >= 3, got " +
                                     std::to_string(num_time_buckets));
  const int64_t C = num_contextual;
  std::vector<int64_t> first_row(B + 1, 0);
  int64_t num_candidates = 0;
  for (size_t b = 0; b < B; ++b) {
    const int64_t events = item_ids[b].size();
    require(actions[b].size() == events && timestamps[b].size() == events,
            "batch_features: request " + std::to_string(b) + " has " + std::to_string(events) + " items but " +
                std::to_string(actions[b].size()) + " actions and " + std::to_string(timestamps[b].size()) +
                " timestamps");
    require(contextual[b].size() == C, "batch_features: request " + std::to_string(b) + " has " +
                                           std::to_string(contextual[b].size()) + " contextual features, expected " +
                                           std::to_string(C));
    const int64_t history = C + 2 * events;
    require(0 <= cached_lens[b] && cached_lens[b] <= history,
            "batch_features: request " + std::to_string(b) + " cached length " + std::to_string(cached_lens[b]) +
                " outside [0, " + std::to_string(history) + "]");
    first_row[b + 1] = first_row[b] + history - cached_lens[b] + candidates[b].size();
    num_candidates += candidates[b].size();
  }
  const int64_t T = first_row[B];
  torch::Tensor dest;
  if (out.has_value()) {
    dest = *out;
    require(dest.device().is_cpu() && dest.scalar_type() == torch::kLong && dest.dim() == 2 && dest.is_contiguous(),
            "batch_features: out must be a contiguous int64 CPU tensor [F, R]");
    require(dest.size(0) >= 4, "batch_features: out needs at least 4 feature rows, got " +
                                   std::to_string(dest.size(0)));
    require(dest.size(1) >= T, "batch_features: a batch of " + std::to_string(T) +
                                   " rows does not fit a buffer of " + std::to_string(dest.size(1)));
  } else {
    dest = torch::empty({4, T}, torch::kLong);
  }
  const int64_t R = dest.size(1);
  int64_t* table = dest.data_ptr<int64_t>();
  int64_t* position = table + R;
  int64_t* bucket = position + R;
  int64_t* type = bucket + R;
  int64_t* candidate_rows = dest.size(0) >= 5 ? type + R : nullptr;
  int64_t m = 0;
  for (size_t b = 0; b < B; ++b) {
    const int64_t* items = item_ids[b].data();
    const int64_t* acts = actions[b].data();
    const int64_t* stamps = timestamps[b].data();
    const int64_t* ctx = contextual[b].data();
    const int64_t history = C + 2 * item_ids[b].size();
    int64_t row = first_row[b];
    int64_t bucket_event = -1, event_bucket = 0;  // an event's item and action tokens share its bucket
    for (int64_t pos = cached_lens[b]; pos < history; ++pos, ++row) {
      position[row] = pos;
      if (pos < C) {
        table[row] = ctx[pos];
        bucket[row] = 0;
        type[row] = kContextual;
        continue;
      }
      const int64_t event = (pos - C) / 2;
      const bool is_action = (pos - C) % 2 == 1;
      table[row] = is_action ? action_offset + acts[event] : item_offset + items[event];
      if (event != bucket_event) {
        event_bucket = time_bucket(event > 0 ? stamps[event] - stamps[event - 1] : 0, num_time_buckets);
        bucket_event = event;
      }
      bucket[row] = event_bucket;
      type[row] = is_action ? kAction : kItem;
    }
    const int64_t* cands = candidates[b].data();
    for (int64_t j = 0; j < candidates[b].size(); ++j, ++row) {
      table[row] = item_offset + cands[j];
      position[row] = history;
      bucket[row] = num_time_buckets - 1;
      type[row] = kCandidate;
      if (candidate_rows != nullptr) candidate_rows[m++] = row;
    }
  }
  for (int64_t f = 0; f < 4; ++f) std::fill(table + f * R + T, table + (f + 1) * R, 0);
  if (candidate_rows != nullptr) std::fill(candidate_rows + num_candidates, candidate_rows + R, 0);
  return dest;
}

}  // namespace

void bind_batch_features(py::module& m) {
  m.def("batch_features", &batch_features, py::arg("item_ids"), py::arg("actions"), py::arg("timestamps"),
        py::arg("contextual"), py::arg("candidates"), py::arg("cached_lens"), py::arg("num_contextual"),
        py::arg("num_time_buckets"), py::arg("item_offset"), py::arg("action_offset"), py::arg("out") = py::none(),
        "Features [4, rows] int64 of a batch's rows (see csrc/batch_features.cpp), into `out` [F >= 4, R >= "
        "rows] when given (zero past the rows; row 4, if any, the candidate rows). Returns the tensor written. "
        "ValueError on inconsistent lengths or a buffer too small.");
}

}  // namespace hstu
