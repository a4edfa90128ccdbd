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

std::pair<std::vector<int32_t>, std::string> HostStorage::lookup(int64_t user) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(user);
  if (it == entries_.end()) return {{}, std::string()};
  return {it->second.slots, it->second.digest};
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
    const auto is_self = [user](int64_t u) { return u == user; };
    const int64_t evictable = evictable_locked(
        is_self, [](const HostUserEntry& e) { return static_cast<int64_t>(e.slots.size()); });
    if (n_chunks > free + evictable) {
      throw CacheCapacityError("host reserve for user " + str(user), n_chunks, free, evictable, num_slots_, "slots");
    }
    evict_lru_locked([&] { return static_cast<int64_t>(free_.size()) < n_chunks; }, is_self,
                     [&](EntryMap::iterator it) { drop_locked(it); });
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

bool HostStorage::commit(int64_t user, const std::vector<int32_t>& slots, int64_t first_chunk, const std::string& digest) {
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
  HostUserEntry& e = use_locked(user);
  if (rewrite) {
    free_slots_locked(e.slots);
    e.slots.clear();
  }
  for (int32_t s : slots) state_[s] = SlotState::kOwned;
  reserved_ -= static_cast<int64_t>(slots.size());
  e.slots.insert(e.slots.end(), slots.begin(), slots.end());
  e.digest = digest;
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
  for (int64_t u : users) ++use_locked(u).pin_count;
}

void HostStorage::unpin(const std::vector<int64_t>& users) {
  std::lock_guard<std::mutex> lock(mu_);
  unpin_locked(users, "host unpin");
}

void HostStorage::invalidate(int64_t user) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = unpinned_locked(user, "host invalidate");
  if (it != entries_.end()) drop_locked(it);
}

int64_t HostStorage::num_free_slots() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(free_.size());
}

int64_t HostStorage::num_reserved_slots() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
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
  forget_locked(it);
}

}  // namespace hstu
