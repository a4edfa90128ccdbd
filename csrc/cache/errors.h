// Errors raised by the cache bookkeeping backends (plain C++17, no torch headers).
//
// CacheCapacityError: one request needs more pages/slots than are free plus evictable (unpinned,
// not part of the request). The manager's state is unchanged when it is thrown. Bound to Python as
// hstu ext.CacheCapacityError (a RuntimeError subclass).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace hstu {

struct CacheCapacityError : std::runtime_error {
  CacheCapacityError(const std::string& what_needs, int64_t needed, int64_t free, int64_t evictable,
                     int64_t total, const std::string& unit)
      : std::runtime_error(what_needs + " needs " + std::to_string(needed) + " " + unit + ", " +
                           std::to_string(free) + " free, " + std::to_string(evictable) +
                           " evictable of " + std::to_string(total) + " total") {}
};

}  // namespace hstu
