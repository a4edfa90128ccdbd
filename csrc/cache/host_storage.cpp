// HostStorage implementation; the state invariants are listed in host_storage.h.
#include "host_storage.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <unordered_set>

namespace hstu {

namespace {
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

HostStorage::HostStorage(int64_t num_slots, int64_t chunk_tokens)
    : num_slots_(num_slots), chunk_tokens_(chunk_tokens) {
  if (num_slots < 0 || num_slots > std::numeric_limits<int32_t>::max() || chunk_tokens < 1) {
    throw std::invalid_argument("HostStorage needs 0 <= num_slots <= 2^31-1 and chunk_tokens >= 1, got num_slots=" +
                                str(num_slots) + ", chunk_tokens=" + str(chunk_tokens));
  }
  free_.reserve(num_slots);
  for (int64_t s = num_slots - 1; s >= 0; --s) free_.push_back(static_cast<int32_t>(s));
  state_.assign(num_slots, SlotState::kFree);
}

std::pair<std::vector<int32_t>, uint64_t> HostStorage::lookup(int64_t user) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user);
  if (it == entries_.end()) return {{}, 0};
  return {it->second.slots, it->second.fingerprint};
}

void HostStorage::touch(int64_t user) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user);
  if (it != entries_.end()) lru_.splice(lru_.end(), lru_, it->second.lru);
}

std::vector<int32_t> HostStorage::reserve(int64_t user, int64_t first_chunk, int64_t n_chunks) {
  std::lock_guard<std::mutex> lock(mu_);
  auto self = entries_.find(user);
  const int64_t committed = self == entries_.end() ? 0 : static_cast<int64_t>(self->second.slots.size());
  if (n_chunks < 1) throw std::invalid_argument("host reserve: n_chunks " + str(n_chunks) + " must be >= 1");
  if (first_chunk != committed && first_chunk != 0) {
    throw std::invalid_argument("host reserve: user " + str(user) + " first_chunk " + str(first_chunk) +
                                " must be 0 (rewrite) or its committed chunk count " + str(committed) + " (append)");
  }
  if (first_chunk == 0 && committed > 0 && self->second.pin_count > 0) {
    throw std::logic_error("host reserve: cannot rewrite user " + str(user) + " while an onload pins it (pin_count " +
                           str(self->second.pin_count) + ")");
  }
  const int64_t free = static_cast<int64_t>(free_.size());
  if (n_chunks > free) {
    int64_t evictable = 0;
    for (int64_t u : lru_) {
      const Entry& e = entries_.at(u);
      if (e.pin_count == 0 && u != user) evictable += static_cast<int64_t>(e.slots.size());
    }
    if (n_chunks > free + evictable) {
      throw CacheCapacityError("host reserve for user " + str(user), n_chunks, free, evictable, num_slots_, "slots");
    }
    for (auto lit = lru_.begin(); static_cast<int64_t>(free_.size()) < n_chunks;) {
      auto it = entries_.find(*lit++);
      if (it->second.pin_count > 0 || it->first == user) continue;
      evicted_.push_back(it->first);
      ++evictions_;
      drop_locked(it);
    }
  }
  std::vector<int32_t> slots(free_.end() - n_chunks, free_.end());
  std::reverse(slots.begin(), slots.end());
  free_.resize(free_.size() - n_chunks);
  for (int32_t s : slots) state_[s] = SlotState::kReserved;
  reserved_ += n_chunks;
  self = entries_.find(user);
  if (self != entries_.end()) lru_.splice(lru_.end(), lru_, self->second.lru);
  return slots;
}

bool HostStorage::commit(int64_t user, const std::vector<int32_t>& slots, int64_t first_chunk, uint64_t fingerprint) {
  std::lock_guard<std::mutex> lock(mu_);
  if (slots.empty()) throw std::invalid_argument("host commit: no slots for user " + str(user));
  check_reserved_locked(slots, "host commit");
  auto it = entries_.find(user);
  const int64_t committed = it == entries_.end() ? 0 : static_cast<int64_t>(it->second.slots.size());
  const bool rewrite = first_chunk == 0;
  if ((!rewrite && first_chunk != committed) || (rewrite && committed > 0 && it->second.pin_count > 0)) {
    free_slots_locked(slots);
    return false;
  }
  if (it == entries_.end()) {
    it = entries_.emplace(user, Entry{}).first;
    it->second.lru = lru_.insert(lru_.end(), user);
  } else {
    lru_.splice(lru_.end(), lru_, it->second.lru);
  }
  Entry& e = it->second;
  if (rewrite) {
    free_slots_locked(e.slots);
    e.slots.clear();
  }
  for (int32_t s : slots) state_[s] = SlotState::kOwned;
  reserved_ -= static_cast<int64_t>(slots.size());
  e.slots.insert(e.slots.end(), slots.begin(), slots.end());
  e.fingerprint = fingerprint;
  return true;
}

void HostStorage::abort(const std::vector<int32_t>& slots) {
  std::lock_guard<std::mutex> lock(mu_);
  check_reserved_locked(slots, "host abort");
  free_slots_locked(slots);
}

void HostStorage::pin(const std::vector<int64_t>& users) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int64_t u : users) {
    if (!entries_.count(u)) throw std::invalid_argument("host pin: user " + str(u) + " has no host chunks");
  }
  for (int64_t u : users) {
    Entry& e = entries_.at(u);
    ++e.pin_count;
    lru_.splice(lru_.end(), lru_, e.lru);
  }
}

void HostStorage::unpin(const std::vector<int64_t>& users) {
  std::lock_guard<std::mutex> lock(mu_);
  std::unordered_map<int64_t, int> count;
  for (int64_t u : users) {
    auto it = entries_.find(u);
    const int pins = it == entries_.end() ? 0 : it->second.pin_count;
    if (++count[u] > pins) {
      throw std::logic_error("host unpin: user " + str(u) + " is not pinned (pin_count " + str(pins) +
                             ", unpinned " + str(count[u]) + " times)");
    }
  }
  for (const auto& [u, k] : count) entries_.at(u).pin_count -= k;
}

void HostStorage::invalidate(int64_t user) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user);
  if (it == entries_.end()) return;
  if (it->second.pin_count > 0) {
    throw std::logic_error("host invalidate: user " + str(user) + " is pinned (pin_count " +
                           str(it->second.pin_count) + ")");
  }
  drop_locked(it);
}

std::vector<int64_t> HostStorage::take_evicted() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  out.swap(evicted_);
  return out;
}

bool HostStorage::contains(int64_t user) const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.count(user) > 0;
}

int HostStorage::pin_count(int64_t user) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user);
  return it == entries_.end() ? 0 : it->second.pin_count;
}

int64_t HostStorage::num_free_slots() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(free_.size());
}

int64_t HostStorage::num_reserved_slots() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}

int64_t HostStorage::num_users() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(entries_.size());
}

int64_t HostStorage::evictions() const {
  std::lock_guard<std::mutex> lock(mu_);
  return evictions_;
}

void HostStorage::check_reserved_locked(const std::vector<int32_t>& slots, const char* op) const {
  std::unordered_set<int32_t> seen;
  for (int32_t s : slots) {
    if (s < 0 || s >= num_slots_ || state_[s] != SlotState::kReserved || !seen.insert(s).second) {
      throw std::invalid_argument(std::string(op) + ": slot " + str(s) + " is not a reserved slot (or repeats)");
    }
  }
}

void HostStorage::free_slots_locked(const std::vector<int32_t>& slots) {
  for (auto s = slots.rbegin(); s != slots.rend(); ++s) {
    if (state_[*s] == SlotState::kReserved) --reserved_;
    state_[*s] = SlotState::kFree;
    free_.push_back(*s);
  }
}

void HostStorage::drop_locked(EntryMap::iterator it) {
  free_slots_locked(it->second.slots);
  lru_.erase(it->second.lru);
  entries_.erase(it);
}

}  // namespace hstu
