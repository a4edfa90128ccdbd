// The planner's split search, ops/kvcache/planner.py plan(), in one C++ pass. The numpy form there
// (plan_numpy) is the reference: it documents the model (timeline, work, bytes) and the tests hold
// this one to it on random batches. Why: plan() runs on the model thread before a host-tier batch's
// onload can start, and its ~50 numpy calls over (candidates x users) took 0.07 ms at batch 1 and
// 0.10-0.14 ms at batch 8 on the dev CPU (benchmarks/RESULTS.md, twenty-eighth session).
//
// Inputs per user u: host_tokens (host-tier prefix), gpu_tokens, history_tokens, candidates, and its
// host chunks' formats: hidden_len[u] chunks hold hidden states, all of them unless hidden_flags[u]
// is non-empty (then the flags, chunk by chunk, say which). Candidate k of K = steps + 1 onloads
// chunks_u * (steps - k) // steps whole chunks of every user (k = 0: all, k = steps: none). Every
// quantity is computed with the same integer and double operations, in the same order, as the numpy
// form, so both choose the same split; the splits predicted within margin_window of the fastest are
// ranked with the layers' compute priced compute_margin higher, the bars use the model as it is
// (CostModel.compute_margin and margin_window say why). The GIL stays held (microseconds).
#include <torch/extension.h>
#include <pybind11/stl.h>

#include "kv_checks.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace hstu {
namespace {

struct Costs {
  double h2d_bytes_per_s, per_row_s, per_pair_s, fixed_s, forward_s, onload_start_s, min_gain, front_s;
  int64_t bytes_per_token_layer, hidden_bytes_per_token_layer;
};

struct Users {
  std::vector<int64_t> host, gpu, history, candidates, hidden_len;
  std::vector<std::vector<bool>> hidden_flags;
  std::vector<std::vector<int64_t>> hidden_counts;  // hidden chunks among each user's first c chunks, c = 0..width
  int64_t width = 0;                                // the longest hidden_len
  bool any_hidden = false;
};

struct Predicted {
  double finish, load, compute;
  int64_t fitted_rows;  // the rows that must fit a graph bucket
};

int64_t padded(int64_t rows, const std::vector<int64_t>& buckets) {
  if (buckets.empty()) return rows;
  const auto it = std::lower_bound(buckets.begin(), buckets.end(), rows);  // the smallest bucket >= rows
  return it == buckets.end() ? rows : *it;
}

double layer_s(const Costs& c, int64_t rows, int64_t pairs, const std::vector<int64_t>& buckets) {
  return c.fixed_s + static_cast<double>(padded(rows, buckets)) * c.per_row_s + static_cast<double>(pairs) * c.per_pair_s;
}

// Rows and attention pairs one layer computes when user u's first computed history position is
// max(gpu_tokens, start[u]).
std::pair<int64_t, int64_t> work(const Users& us, const std::vector<int64_t>& start) {
  int64_t rows = 0, pairs = 0;
  for (size_t u = 0; u < start.size(); ++u) {
    const int64_t n = us.history[u], m = us.candidates[u], first = std::max(us.gpu[u], start[u]);
    rows += n - first + m;
    pairs += (n * (n + 1) - first * (first + 1)) / 2 + m * (n + 1);
  }
  return {rows, pairs};
}

// Bytes per layer onloaded when user u loads host tokens [start[u], end[u]).
double loaded_bytes(const Costs& c, const Users& us, const std::vector<int64_t>& start,
                    const std::vector<int64_t>& end, int64_t chunk) {
  const int64_t kv = c.bytes_per_token_layer;
  int64_t total = 0;
  for (size_t u = 0; u < start.size(); ++u) total += (end[u] - start[u]) * kv;
  if (!c.hidden_bytes_per_token_layer || !us.any_hidden) return static_cast<double>(total);
  int64_t saved = 0;
  for (size_t u = 0; u < start.size(); ++u) {
    const int64_t hi = std::min((end[u] + chunk - 1) / chunk, us.width), lo = std::min(start[u] / chunk, us.width);
    const auto& counts = us.hidden_counts[u];
    const int64_t hidden_tokens = std::min((counts[hi] - counts[lo]) * chunk, end[u] - start[u]);
    saved += hidden_tokens * (kv - c.hidden_bytes_per_token_layer);
  }
  return static_cast<double>(total - saved);
}

double timeline(const Costs& c, int64_t num_layers, double onloaded, double layer, double first) {
  const double L = static_cast<double>(num_layers);
  const double load = onloaded / c.h2d_bytes_per_s;
  const double start = onloaded > 0 ? c.onload_start_s : 0.0;
  const double computed = first + L * layer;
  const double waited = start + std::max(load + L * layer, L * load + layer);
  return c.forward_s + (onloaded > 0 ? std::max(computed, waited) : computed);
}

Predicted predict(const Costs& c, const Users& us, const std::vector<int64_t>& onload, int64_t num_layers,
                  int64_t chunk, const std::vector<int64_t>& buckets, bool front) {
  const size_t U = onload.size();
  const double L = static_cast<double>(num_layers);
  double layer, first = 0.0, loaded;
  int64_t fitted;
  if (front) {  // host_split "compute_front": the prefix's front recomputed in a pass of its own
    std::vector<int64_t> fronts(U), whole(U);
    int64_t f_rows = 0, f_pairs = 0;
    for (size_t u = 0; u < U; ++u) {
      const int64_t p = onload[u], h = us.host[u];
      fronts[u] = (p > 0 && p < h) ? std::max<int64_t>(0, h - p) / chunk * chunk : 0;
      whole[u] = p > 0 ? h : 0;
      f_rows += fronts[u];
      f_pairs += fronts[u] * (fronts[u] + 1) / 2;
    }
    if (f_rows > 0) first = c.front_s + layer_s(c, f_rows, f_pairs, buckets) * L;
    const auto [rows, pairs] = work(us, whole);
    layer = layer_s(c, rows, pairs, buckets);
    loaded = loaded_bytes(c, us, fronts, whole, chunk);
    fitted = f_rows;
  } else {
    const auto [rows, pairs] = work(us, onload);
    layer = layer_s(c, rows, pairs, buckets);
    loaded = loaded_bytes(c, us, std::vector<int64_t>(U, 0), onload, chunk);
    fitted = rows;
  }
  return {timeline(c, num_layers, loaded, layer, first), loaded / c.h2d_bytes_per_s * L, first + layer * L, fitted};
}

std::tuple<std::vector<int64_t>, double, double, double> split_plan(
    std::vector<int64_t> host, std::vector<int64_t> gpu, std::vector<int64_t> history, std::vector<int64_t> candidates,
    std::vector<int64_t> hidden_len, std::vector<std::vector<bool>> hidden_flags, double h2d_bytes_per_s,
    int64_t bytes_per_token_layer, int64_t hidden_bytes_per_token_layer, double per_row_s, double per_pair_s,
    double fixed_s, double forward_s, double onload_start_s, double min_gain, double front_s, int64_t num_layers,
    int64_t chunk_tokens, std::vector<int64_t> buckets, bool front, double compute_margin, double margin_window) {
  const size_t U = host.size();
  require(gpu.size() == U && history.size() == U && candidates.size() == U && hidden_len.size() == U &&
              hidden_flags.size() == U,
          "split_plan: every per-user list needs " + std::to_string(U) + " entries");
  require(chunk_tokens > 0, "split_plan: chunk_tokens must be positive, got " + std::to_string(chunk_tokens));
  require(h2d_bytes_per_s > 0, "split_plan: h2d_bytes_per_s must be positive");
  const Costs c{h2d_bytes_per_s, per_row_s, per_pair_s, fixed_s, forward_s, onload_start_s, min_gain, front_s,
                bytes_per_token_layer, hidden_bytes_per_token_layer};
  Users us{std::move(host), std::move(gpu), std::move(history), std::move(candidates), std::move(hidden_len),
           std::move(hidden_flags), {}, 0, false};
  for (size_t u = 0; u < U; ++u) {
    const int64_t n = us.hidden_len[u];
    require(us.hidden_flags[u].empty() || static_cast<int64_t>(us.hidden_flags[u].size()) == n,
            "split_plan: user " + std::to_string(u) + " has " + std::to_string(us.hidden_flags[u].size()) +
                " hidden flags for " + std::to_string(n) + " chunks");
    us.width = std::max(us.width, n);
    us.any_hidden = us.any_hidden || n > 0;
  }
  us.hidden_counts.resize(U);
  for (size_t u = 0; u < U; ++u) {  // min(c, n) for a user whose chunks all hold hidden states, else a running count
    auto& counts = us.hidden_counts[u];
    counts.assign(us.width + 1, 0);
    int64_t seen = 0;
    for (int64_t k = 1; k <= us.width; ++k) {
      if (k <= us.hidden_len[u]) seen += us.hidden_flags[u].empty() ? 1 : static_cast<int64_t>(us.hidden_flags[u][k - 1]);
      counts[k] = seen;
    }
  }

  int64_t steps = 0;
  std::vector<int64_t> chunks(U);
  for (size_t u = 0; u < U; ++u) {
    chunks[u] = us.host[u] / chunk_tokens;
    steps = std::max(steps, chunks[u]);
  }
  if (steps == 0) {
    const std::vector<int64_t> zero(U, 0);
    const auto p = predict(c, us, zero, num_layers, chunk_tokens, buckets, false);
    return {zero, p.finish, p.load, p.compute};
  }
  // The splits predicted within margin_window of the fastest are ranked with the layers' compute
  // priced compute_margin higher (plan_numpy's _with_compute_margin); the bars below use the model as it is.
  const double scale = 1.0 + compute_margin;
  Costs ranking = c;
  ranking.fixed_s *= scale;
  ranking.per_row_s *= scale;
  ranking.per_pair_s *= scale;
  std::vector<std::vector<int64_t>> onload(steps + 1, std::vector<int64_t>(U));
  std::vector<Predicted> predicted;
  std::vector<double> ranked(steps + 1);
  predicted.reserve(steps + 1);
  for (int64_t k = 0; k <= steps; ++k) {
    for (size_t u = 0; u < U; ++u) onload[k][u] = chunks[u] * (steps - k) / steps * chunk_tokens;
    predicted.push_back(predict(c, us, onload[k], num_layers, chunk_tokens, buckets, front));
    ranked[k] = compute_margin != 0.0 ? predict(ranking, us, onload[k], num_layers, chunk_tokens, buckets, front).finish
                                      : predicted[k].finish;
  }
  // A split (0 < k < steps) past the largest bucket runs eagerly, which the model does not describe.
  auto split = [&](int64_t k) { return 0 < k && k < steps; };
  auto skipped = [&](int64_t k) { return split(k) && !buckets.empty() && predicted[k].fitted_rows > buckets.back(); };
  double fastest = predicted[0].finish;  // (pure onload and recompute are never skipped)
  for (int64_t k = 1; k <= steps; ++k) {
    if (!skipped(k)) fastest = std::min(fastest, predicted[k].finish);
  }
  int64_t best = -1;
  for (int64_t k = 0; k <= steps; ++k) {  // ties keep the earlier (more onload)
    if (skipped(k) || predicted[k].finish > fastest * (1 + margin_window)) continue;
    if (best < 0 || ranked[k] < ranked[best] * (1 - 1e-9)) best = k;
  }
  const int64_t whole = 0, recompute = steps;
  if (split(best) && predicted[best].finish > predicted[whole].finish * (1 - min_gain)) best = whole;
  const int64_t chosen = predicted[best].finish <= predicted[recompute].finish * (1 - min_gain) ? best : recompute;
  const auto& p = predicted[chosen];
  return {onload[chosen], p.finish, p.load, p.compute};
}

}  // namespace

void bind_split_planner(py::module& m) {
  m.def("split_plan", &split_plan, py::arg("host_tokens"), py::arg("gpu_tokens"), py::arg("history_tokens"),
        py::arg("candidates"), py::arg("hidden_len"), py::arg("hidden_flags"), py::arg("h2d_bytes_per_s"),
        py::arg("bytes_per_token_layer"), py::arg("hidden_bytes_per_token_layer"), py::arg("per_row_s"),
        py::arg("per_pair_s"), py::arg("fixed_s"), py::arg("forward_s"), py::arg("onload_start_s"),
        py::arg("min_gain"), py::arg("front_s"), py::arg("num_layers"), py::arg("chunk_tokens"), py::arg("buckets"),
        py::arg("front"), py::arg("compute_margin"), py::arg("margin_window"),
        "The planner's split (ops/kvcache/planner.py plan()): (onload tokens per user, predicted batch, onload and "
        "compute seconds). ValueError on inconsistent lengths.");
}

}  // namespace hstu
