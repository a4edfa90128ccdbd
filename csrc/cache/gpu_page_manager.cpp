// GpuPageManager implementation; the state invariants are listed in gpu_page_manager.h.
#include "gpu_page_manager.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_set>

namespace hstu {

namespace {
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

GpuPageManager::GpuPageManager(int64_t num_pages, int64_t page_size)
    : num_pages_(num_pages), page_size_(page_size) {
  if (num_pages < 1 || num_pages > std::numeric_limits<int32_t>::max() || page_size < 1) {
    throw std::invalid_argument("GpuPageManager needs 1 <= num_pages <= 2^31-1 and page_size >= 1, got num_pages=" +
                                str(num_pages) + ", page_size=" + str(page_size));
  }
  free_.reserve(num_pages);
  for (int64_t p = num_pages - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
}

std::pair<int64_t, std::string> GpuPageManager::lookup(int64_t user) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user);
  if (it == entries_.end()) return {0, std::string()};
  return {it->second.length, it->second.digest};
}

std::vector<std::vector<int32_t>> GpuPageManager::reserve(const std::vector<int64_t>& users,
                                                          const std::vector<int64_t>& keep_lens,
                                                          const std::vector<int64_t>& target_lens) {
  const size_t n = users.size();
  if (keep_lens.size() != n || target_lens.size() != n) {
    throw std::invalid_argument("reserve: users, keep_lens, target_lens differ in length (" + str(n) + ", " +
                                str(keep_lens.size()) + ", " + str(target_lens.size()) + ")");
  }
  std::lock_guard<std::mutex> lock(mu_);

  // Plan without touching state, so every error below leaves the manager unchanged.
  std::unordered_set<int64_t> in_call;
  std::vector<int64_t> want(n);
  int64_t grow = 0, shrink = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t u = users[i], keep = keep_lens[i], target = target_lens[i];
    if (!in_call.insert(u).second) throw std::invalid_argument("reserve: user " + str(u) + " appears twice");
    auto it = entries_.find(u);
    const int64_t length = it == entries_.end() ? 0 : it->second.length;
    const int64_t have = it == entries_.end() ? 0 : static_cast<int64_t>(it->second.pages.size());
    const int pins = it == entries_.end() ? 0 : it->second.pin_count;
    if (keep < 0 || keep > length) {
      throw std::invalid_argument("reserve: user " + str(u) + " keep_len " + str(keep) + " not in [0, cached length " +
                                  str(length) + "]");
    }
    if (target < std::max<int64_t>(keep, 1)) {
      throw std::invalid_argument("reserve: user " + str(u) + " target_len " + str(target) +
                                  " must be >= max(keep_len " + str(keep) + ", 1)");
    }
    want[i] = (target + page_size_ - 1) / page_size_;
    if (pins > 0 && (keep < length || want[i] < have)) {
      throw std::logic_error("reserve: user " + str(u) + " is pinned by an in-flight batch (pin_count " + str(pins) +
                             "); cannot shrink it from length " + str(length) + " / " + str(have) +
                             " pages to keep_len " + str(keep) + " / " + str(want[i]) + " pages");
    }
    grow += std::max<int64_t>(0, want[i] - have);
    shrink += std::max<int64_t>(0, have - want[i]);
  }
  const int64_t free = static_cast<int64_t>(free_.size()) + shrink;
  const auto in_this_call = [&](int64_t u) { return in_call.count(u) > 0; };
  if (grow > free) {
    const int64_t evictable = evictable_locked(
        in_this_call, [](const GpuUserEntry& e) { return static_cast<int64_t>(e.pages.size()); });
    if (grow > free + evictable) throw CacheCapacityError("batch", grow, free, evictable, num_pages_, "pages");
  }

  // Apply: free surplus pages of users in the call, evict LRU users until the growth fits, grow.
  for (size_t i = 0; i < n; ++i) {
    auto it = entries_.find(users[i]);
    if (it == entries_.end()) continue;
    std::vector<int32_t>& pages = it->second.pages;
    while (static_cast<int64_t>(pages.size()) > want[i]) {
      free_.push_back(pages.back());
      pages.pop_back();
    }
  }
  evict_lru_locked([&] { return static_cast<int64_t>(free_.size()) < grow; }, in_this_call,
                   [&](EntryMap::iterator it) { drop_locked(it); });
  std::vector<std::vector<int32_t>> result;
  result.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    GpuUserEntry& e = use_locked(users[i]);
    while (static_cast<int64_t>(e.pages.size()) < want[i]) {
      e.pages.push_back(free_.back());
      free_.pop_back();
      ++allocations_;
    }
    if (e.length != keep_lens[i]) e.digest.clear();  // a shortened prefix has no known identity until commit
    e.length = keep_lens[i];
    ++e.pin_count;
    result.push_back(e.pages);
  }
  return result;
}

void GpuPageManager::commit(int64_t user, int64_t length, const std::string& digest) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user);
  if (it == entries_.end()) throw std::invalid_argument("commit: user " + str(user) + " has no pages");
  GpuUserEntry& e = it->second;
  const int64_t capacity = static_cast<int64_t>(e.pages.size()) * page_size_;
  if (length < 0 || length > capacity) {
    throw std::invalid_argument("commit: user " + str(user) + " length " + str(length) + " not in [0, " +
                                str(capacity) + "] (pages * page_size)");
  }
  e.length = length;
  e.digest = digest;
}

void GpuPageManager::release(const std::vector<int64_t>& users) {
  std::lock_guard<std::mutex> lock(mu_);
  unpin_locked(users, "release");
}

void GpuPageManager::invalidate(int64_t user) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = unpinned_locked(user, "invalidate");
  if (it != entries_.end()) drop_locked(it);
}

std::vector<int32_t> GpuPageManager::pages(int64_t user) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user);
  return it == entries_.end() ? std::vector<int32_t>{} : it->second.pages;
}



int64_t GpuPageManager::num_free_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(free_.size());
}



int64_t GpuPageManager::allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return allocations_;
}

void GpuPageManager::drop_locked(EntryMap::iterator it) {
  const std::vector<int32_t>& pages = it->second.pages;
  free_.insert(free_.end(), pages.rbegin(), pages.rend());
  forget_locked(it);
}

}  // namespace hstu
