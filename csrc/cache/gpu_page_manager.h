// GpuPageManager: bookkeeping of the GPU KV page pool. It hands out page ids only; the page table
// tensor [num_layers, num_pages, 2, page_size, H, d] lives in Python.
//
// Lifecycle of a user: reserve (pages for keep_len cached + new tokens, pin) -> the batch writes
// K/V -> commit (valid length, digest) -> release (unpin). Unpinned users stay cached and are
// evicted least-recently-used first when a reserve runs short of free pages.
//
// Invariants (hold between calls; all state is guarded by mu_):
//  - every page id in [0, num_pages) is either in free_ or in exactly one user's pages:
//    free_.size() + sum(user.pages.size()) == num_pages.
//  - a user's pages cover its tokens from position 0; 0 <= length <= pages.size() * page_size,
//    and every user holds at least one page.
//  - lru_ lists every user exactly once, least recently used first; entry.lru points at it.
//    reserve is the only "use"; lookup does not reorder.
//  - a user with pin_count > 0 is never evicted or invalidated and its page list only grows; its
//    valid length only changes through commit.
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

struct GpuUserEntry {
  std::vector<int32_t> pages;
  int64_t length = 0;
  std::string digest;  // exact identity of the valid prefix (opaque bytes, see model/identity.py)
  int pin_count = 0;
  std::list<int64_t>::iterator lru;
};

class GpuPageManager : public UserIndex<GpuUserEntry> {
 public:
  GpuPageManager(int64_t num_pages, int64_t page_size);

  // (valid length, digest); (0, "") if the user is not cached. Does not change the LRU order.
  std::pair<int64_t, std::string> lookup(int64_t user) const;

  // All-or-nothing: for each user keep the pages covering its first keep_lens[i] tokens, size its
  // page list to ceil(target_lens[i] / page_size) pages (surplus own pages are reused for the new
  // tokens before free ones), set length = keep_lens[i], pin it and mark it most recently used.
  // Evicts LRU unpinned users outside this call if free pages run short. Returns each user's page
  // list. Throws std::invalid_argument (duplicate user, keep_len > length, target_len <
  // max(keep_len, 1)), std::logic_error (shrinking a pinned user), CacheCapacityError.
  std::vector<std::vector<int32_t>> reserve(const std::vector<int64_t>& users,
                                            const std::vector<int64_t>& keep_lens,
                                            const std::vector<int64_t>& target_lens);

  // Sets the user's valid length (<= pages * page_size) and the digest of that prefix.
  void commit(int64_t user, int64_t length, const std::string& digest);
  // Unpins each listed user once (a user listed k times is unpinned k times); all-or-nothing.
  void release(const std::vector<int64_t>& users);
  // Drops the user and frees its pages; no-op if absent; std::logic_error if pinned.
  void invalidate(int64_t user);

  std::vector<int32_t> pages(int64_t user) const;  // empty if absent
  int64_t num_free_pages() const;
  int64_t num_pages() const { return num_pages_; }
  int64_t page_size() const { return page_size_; }
  int64_t allocations() const;  // pages handed out by reserve, cumulative

 private:

  void drop_locked(EntryMap::iterator it);  // frees the pages, forgets the user

  const int64_t num_pages_;
  const int64_t page_size_;
  std::vector<int32_t> free_;  // stack; the lowest ids are handed out first
  int64_t allocations_ = 0;
  // contains, pin_count, num_users, evictions, take_evicted: from UserIndex.
};

}  // namespace hstu
