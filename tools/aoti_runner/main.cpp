// hstu_aoti_runner: ranks batches with an `hstu export` package (AOTInductor .pt2), no Python.
//
//   hstu_aoti_runner model.pt2 [batches.txt]
//
// The package holds the whole cached forward (engine/exported.py): each run looks the users up in
// the package's own KV cache, computes only their new history tokens and the candidates, and
// commits; the cache lives as long as the loaded package. Without a batches file a synthetic
// workload of returning users is ranked (histories grow between rounds, so later rounds hit the
// cache). A batches file has one request per line, a blank line ending each batch:
//   user_id C contextual*C E item_ids*E actions*E timestamps*E M candidates*M
// Output: one line per candidate, `user=U item=I logits=l0,l1,...`, a line per batch, and the
// cache's counters at the end.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Request {
  int64_t user = 0;
  std::vector<int64_t> contextual, items, actions, timestamps, candidates;
};
using Batch = std::vector<Request>;

std::vector<int64_t> read_values(std::istringstream& in, const std::string& what, int64_t user) {
  int64_t n = -1;
  if (!(in >> n) || n < 0) throw std::runtime_error("user " + std::to_string(user) + ": bad " + what + " count");
  std::vector<int64_t> values(n);
  for (auto& v : values) {
    if (!(in >> v)) throw std::runtime_error("user " + std::to_string(user) + ": " + what + " ends early");
  }
  return values;
}

std::vector<Batch> read_batches(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw std::runtime_error("cannot open batches file " + path);
  std::vector<Batch> batches(1);
  std::string line;
  while (std::getline(file, line)) {
    std::istringstream in(line);
    Request r;
    if (!(in >> r.user)) {
      if (!batches.back().empty()) batches.emplace_back();
      continue;
    }
    r.contextual = read_values(in, "contextual", r.user);
    const auto events = read_values(in, "item_ids", r.user);
    r.items = events;
    for (auto* field : {&r.actions, &r.timestamps}) {
      field->resize(events.size());
      for (auto& v : *field) {
        if (!(in >> v)) throw std::runtime_error("user " + std::to_string(r.user) + ": events end early");
      }
    }
    r.candidates = read_values(in, "candidates", r.user);
    batches.back().push_back(std::move(r));
  }
  if (batches.back().empty()) batches.pop_back();
  return batches;
}

int64_t meta(const std::unordered_map<std::string, std::string>& metadata, const std::string& key) {
  auto it = metadata.find(key);
  if (it == metadata.end()) throw std::runtime_error("package metadata has no " + key + " (not an `hstu export` package?)");
  return std::stoll(it->second);
}

// Rounds of up to 3 of 6 users; each returning user's history grows by 1-4 events.
std::vector<Batch> synthetic_batches(const std::unordered_map<std::string, std::string>& metadata) {
  const int64_t C = meta(metadata, "num_contextual"), features = meta(metadata, "num_contextual_features");
  const int64_t items = meta(metadata, "num_items"), actions = meta(metadata, "num_actions");
  std::mt19937_64 rng(0);
  auto below = [&](int64_t n) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(n)); };
  std::map<int64_t, Request> users;
  std::vector<Batch> batches;
  for (int round = 0; round < 8; ++round) {
    Batch batch;
    const int64_t first = below(6), size = 1 + below(3);
    for (int64_t i = 0; i < size; ++i) {
      const int64_t u = (first + 2 * i) % 6;
      Request& r = users[u];
      r.user = u;
      r.contextual.resize(C);
      for (int64_t c = 0; c < C; ++c) r.contextual[c] = (u * 7919 + c * 104729) % features;
      for (int64_t e = 1 + below(4); e > 0; --e) {
        r.items.push_back(below(items));
        r.actions.push_back(below(actions));
        r.timestamps.push_back((r.timestamps.empty() ? 1000 : r.timestamps.back()) + below(5000));
      }
      r.candidates = {below(items), below(items)};
      batch.push_back(r);
    }
    batches.push_back(std::move(batch));
  }
  return batches;
}

// The exported forward's inputs (engine/exported.py BatchInputs order).
std::vector<at::Tensor> inputs(const Batch& batch, const c10::Device& device) {
  std::vector<int64_t> users, contextual, items, actions, timestamps, event_counts, candidates, candidate_counts;
  for (const auto& r : batch) {
    users.push_back(r.user);
    contextual.insert(contextual.end(), r.contextual.begin(), r.contextual.end());
    items.insert(items.end(), r.items.begin(), r.items.end());
    actions.insert(actions.end(), r.actions.begin(), r.actions.end());
    timestamps.insert(timestamps.end(), r.timestamps.begin(), r.timestamps.end());
    event_counts.push_back(static_cast<int64_t>(r.items.size()));
    candidates.insert(candidates.end(), r.candidates.begin(), r.candidates.end());
    candidate_counts.push_back(static_cast<int64_t>(r.candidates.size()));
  }
  auto t = [&](const std::vector<int64_t>& v) { return torch::tensor(v, torch::kLong).to(device); };
  const auto B = static_cast<int64_t>(batch.size());
  const int64_t C = B ? static_cast<int64_t>(batch.front().contextual.size()) : 0;
  return {t(users), t(contextual).view({B, C}), t(items), t(actions), t(timestamps), t(event_counts),
          t(candidates), t(candidate_counts)};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::cerr << "usage: " << argv[0] << " model.pt2 [batches.txt]\n";
    return 2;
  }
  try {
    torch::InferenceMode guard;
    torch::inductor::AOTIModelPackageLoader loader(argv[1]);
    const auto metadata = loader.get_metadata();
    const auto device = c10::Device(metadata.count("AOTI_DEVICE_KEY") ? metadata.at("AOTI_DEVICE_KEY") : "cpu");
    const auto batches = argc == 3 ? read_batches(argv[2]) : synthetic_batches(metadata);
    std::cout << std::setprecision(9);
    for (size_t k = 0; k < batches.size(); ++k) {
      const auto started = std::chrono::steady_clock::now();
      auto outputs = loader.run(inputs(batches[k], device));
      const auto logits = outputs.at(0).to(torch::kCPU, torch::kFloat).contiguous();
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
      int64_t row = 0;
      for (const auto& r : batches[k]) {
        for (int64_t item : r.candidates) {
          std::cout << "user=" << r.user << " item=" << item << " logits=";
          for (int64_t t = 0; t < logits.size(1); ++t) std::cout << (t ? "," : "") << logits[row][t].item<float>();
          std::cout << "\n";
          ++row;
        }
      }
      std::cout << "batch=" << k << " users=" << batches[k].size() << " candidates=" << row << " ms=" << ms << "\n";
    }
    for (auto& [name, obj] : loader.get_custom_objs()) {
      torch::jit::Object cache(obj.toObject());
      std::cout << "cache " << name << " reused_tokens=" << cache.run_method("reused_tokens").toInt()
                << " evictions=" << cache.run_method("evictions").toInt()
                << " onloaded_tokens=" << cache.run_method("onloaded_tokens").toInt()
                << " offloaded_chunks=" << cache.run_method("offloaded_chunks").toInt()
                << " invalidations=" << cache.run_method("invalidations").toInt()
                << " users=" << cache.run_method("num_users").toInt() << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "hstu_aoti_runner: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
