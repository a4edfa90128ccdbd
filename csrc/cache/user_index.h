// UserIndex<Entry>: the per-user bookkeeping both cache tiers share (GpuPageManager, HostStorage).
//
// Owns one mutex, the map user -> Entry, the user-level LRU (one std::list, front = least recently
// used; entry.lru points at the user's node) and the users evicted since take_evicted(). Entry must
// have `int pin_count` and `std::list<int64_t>::iterator lru`. The public getters lock; the
// *_locked helpers expect the caller (a derived class method) to hold mu_.
#pragma once

#include <cstdint>
#include <list>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace hstu {

template <typename Entry>
class UserIndex {
 public:
  bool contains(int64_t user) const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.count(user) > 0;
  }
  int pin_count(int64_t user) const {  // 0 if absent
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(user);
    return it == entries_.end() ? 0 : it->second.pin_count;
  }
  int64_t num_users() const {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(entries_.size());
  }
  int64_t evictions() const {
    std::lock_guard<std::mutex> lock(mu_);
    return evictions_;
  }
  // Users evicted since the last call, in eviction order.
  std::vector<int64_t> take_evicted() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<int64_t> out;
    out.swap(evicted_);
    return out;
  }

 protected:
  using EntryMap = std::unordered_map<int64_t, Entry>;

  // The user's entry, created most recently used if absent, else moved to most recently used.
  Entry& use_locked(int64_t user) {
    auto it = entries_.find(user);
    if (it == entries_.end()) {
      it = entries_.emplace(user, Entry{}).first;
      it->second.lru = lru_.insert(lru_.end(), user);
    } else {
      lru_.splice(lru_.end(), lru_, it->second.lru);
    }
    return it->second;
  }

  void forget_locked(typename EntryMap::iterator it) {
    lru_.erase(it->second.lru);
    entries_.erase(it);
  }

  // Sum of size(entry) over users that are unpinned and not skipped (what eviction could free).
  template <typename Skip, typename Size>
  int64_t evictable_locked(Skip skip, Size size) const {
    int64_t total = 0;
    for (int64_t u : lru_) {
      const Entry& e = entries_.at(u);
      if (e.pin_count == 0 && !skip(u)) total += size(e);
    }
    return total;
  }

  // Evicts unpinned, not-skipped users least recently used first while more() holds; drop(it)
  // frees an entry's resources and forgets it.
  template <typename More, typename Skip, typename Drop>
  void evict_lru_locked(More more, Skip skip, Drop drop) {
    for (auto lit = lru_.begin(); lit != lru_.end() && more();) {
      auto it = entries_.find(*lit++);
      if (it->second.pin_count > 0 || skip(it->first)) continue;
      evicted_.push_back(it->first);
      ++evictions_;
      drop(it);
    }
  }

  // Unpins each listed user once (k times if listed k times); all-or-nothing.
  void unpin_locked(const std::vector<int64_t>& users, const char* op) {
    std::unordered_map<int64_t, int> count;
    for (int64_t u : users) {
      auto it = entries_.find(u);
      const int pins = it == entries_.end() ? 0 : it->second.pin_count;
      if (++count[u] > pins) {
        throw std::logic_error(std::string(op) + ": user " + std::to_string(u) + " is not pinned (pin_count " +
                               std::to_string(pins) + ", unpinned " + std::to_string(count[u]) + " times)");
      }
    }
    for (const auto& [u, k] : count) entries_.at(u).pin_count -= k;
  }

  // The user's entry for invalidation: end() if absent; std::logic_error if pinned.
  typename EntryMap::iterator unpinned_locked(int64_t user, const char* op) {
    auto it = entries_.find(user);
    if (it != entries_.end() && it->second.pin_count > 0) {
      throw std::logic_error(std::string(op) + ": user " + std::to_string(user) + " is pinned (pin_count " +
                             std::to_string(it->second.pin_count) + ")");
    }
    return it;
  }

  mutable std::mutex mu_;
  EntryMap entries_;
  std::list<int64_t> lru_;  // front = least recently used

 private:
  std::vector<int64_t> evicted_;
  int64_t evictions_ = 0;
};

}  // namespace hstu
