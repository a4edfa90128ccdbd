// HostStorage: index and slot allocator of the host KV arena. The arena tensor
// [num_slots, num_layers, pages_per_chunk, 2, page_size, H, d] is allocated in Python (pinned on
// CUDA hosts); a slot holds one chunk of chunk_tokens tokens of one user, all layers.
//
// Lifecycle of an offload: reserve (slots for chunks [first_chunk, first_chunk + n) of a user) ->
// D2H copy into the slots -> commit (the slots become the user's chunks) or abort (slots freed).
// An onload pins the user while it reads its slots, then unpins.
//
// Invariants (hold between calls; all state is guarded by mu_):
//  - every slot id in [0, num_slots) is in exactly one state: free (in free_), reserved (handed
//    out by reserve, owned by no user until commit/abort) or owned by exactly one user;
//    state_[s] records which, and free_.size() + reserved + sum(user.slots.size()) == num_slots.
//  - user.slots[i] holds tokens [i * chunk_tokens, (i + 1) * chunk_tokens) of that user; there are
//    no holes (appends start exactly at the committed chunk count), and every user owns >= 1 slot.
//  - lru_ lists every user exactly once, least recently used first; entry.lru points at it.
//  - a user with pin_count > 0 is never evicted, invalidated or rewritten; reserved slots are never
//    evicted.
//  - evicted_ lists the users evicted since the last take_evicted(), in eviction order.
#pragma once

#include <cstdint>
#include <list>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "errors.h"
#include "user_index.h"

namespace hstu {

struct HostUserEntry {
  std::vector<int32_t> slots;
  std::string digest;  // exact identity of the committed prefix (opaque bytes)
  int pin_count = 0;
  std::list<int64_t>::iterator lru;
};

class HostStorage : public UserIndex<HostUserEntry> {
 public:
  HostStorage(int64_t num_slots, int64_t chunk_tokens);

  // (the user's slots in chunk order, digest of the committed prefix); ({}, "") if absent.
  // Does not change the LRU order.
  std::pair<std::vector<int32_t>, std::string> lookup(int64_t user) const;
  // Marks the user most recently used; no-op if absent.
  void touch(int64_t user);

  // Reserves n_chunks >= 1 free slots for chunks [first_chunk, first_chunk + n_chunks) of the user.
  // first_chunk must be the user's committed chunk count (append) or 0 (rewrite; the old slots are
  // freed at commit). Evicts LRU unpinned users other than this one if free slots run short; throws
  // CacheCapacityError (state unchanged) when that is not enough, std::invalid_argument for a bad
  // first_chunk / n_chunks, std::logic_error for a rewrite of a pinned user. Marks the user MRU.
  std::vector<int32_t> reserve(int64_t user, int64_t first_chunk, int64_t n_chunks);

  // Makes reserved slots the user's chunks [first_chunk, ...) (replacing all chunks when
  // first_chunk == 0) and sets the digest; returns true. Returns false and frees the slots
  // instead when the commit would leave a hole (user evicted/invalidated/rewritten meanwhile, so
  // first_chunk no longer equals its chunk count) or when a rewrite finds the user pinned.
  bool commit(int64_t user, const std::vector<int32_t>& slots, int64_t first_chunk, const std::string& digest);
  // Returns reserved slots to the free list.
  void abort(const std::vector<int32_t>& slots);

  // Pins each listed user once (marks it MRU); std::invalid_argument if absent; all-or-nothing.
  void pin(const std::vector<int64_t>& users);
  // Unpins each listed user once; std::logic_error if not pinned; all-or-nothing.
  void unpin(const std::vector<int64_t>& users);
  // Drops the user and frees its slots; no-op if absent; std::logic_error if pinned.
  void invalidate(int64_t user);

  int64_t num_free_slots() const;
  int64_t num_reserved_slots() const;
  int64_t num_slots() const { return num_slots_; }
  int64_t chunk_tokens() const { return chunk_tokens_; }

 private:
  enum class SlotState : uint8_t { kFree, kReserved, kOwned };

  void check_reserved_locked(const std::vector<int32_t>& slots, const char* op) const;
  void free_slots_locked(const std::vector<int32_t>& slots);
  void drop_locked(EntryMap::iterator it);  // frees the slots, forgets the user

  const int64_t num_slots_;
  const int64_t chunk_tokens_;
  std::vector<int32_t> free_;  // stack; the lowest ids are handed out first
  std::vector<SlotState> state_;
  int64_t reserved_ = 0;
  // contains, pin_count, num_users, evictions, take_evicted: from UserIndex.
};

}  // namespace hstu
