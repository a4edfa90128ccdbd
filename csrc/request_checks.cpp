// One request's arrays, checked and turned into identity records in C++: a 4k-event request took
// ~40 us of numpy calls to validate (two reductions per field, a diff) and ~20 us to lay out its
// token records, on the model thread of every in-process batch. Here each is one pass.
//
// check_request(item_ids, actions, timestamps, candidates, contextual, num_items, num_actions,
//               num_contextual_features) -> (field, index, value)
//   The first violation, checked in this order (model/batch.py formats the message):
//     field 0  none (index = value = 0)
//     field 1  item_ids[index] = value outside [0, num_items)
//     field 2  candidates[index] = value outside [0, num_items)
//     field 3  actions[index] = value outside [0, num_actions)
//     field 4  contextual[index] = value outside [0, num_contextual_features)
//     field 5  timestamps[index] < timestamps[index - 1] (value = timestamps[index])
//     field 6  timestamps[0] = value < 0 (past field 5's check the first is the smallest)
//   Lengths and counts are the caller's checks (they need no pass over the values).
//
// token_records(contextual, item_ids, actions, timestamps) -> int64 [C + 2E, 2] (a new array)
//   The layout of model/identity.py: contextual token c = [contextual[c], 0]; event e's item token
//   [item_ids[e], timestamps[e]], then its action token [actions[e], timestamps[e]].
//   Little-endian int64 (every platform torch builds for); equal lengths are the caller's check.
//
// same_bytes(a, b, start, stop) -> bool
//   Whether bytes [start, stop) of two buffers (the identity records' memoryviews) are equal: one
//   memcmp in place, where comparing bytes() copies of a 4k-token history's records cost ~8.6 us a
//   request on the dev CPU inside a batch's lookup (two 64 KB allocations and copies), ~1 us here.
//   Both must be C-contiguous and hold stop bytes; 0 <= start <= stop.
//
// int_array(text) -> int64 [n], or None
//   `text` (bytes of one JSON value) read as an array of integers in one pass: no Python int per
//   value, where msgspec's lists and numpy's conversion of them took ~0.4 ms for a 4k-event
//   columnar body. None for anything else: another JSON type anywhere, a value outside int64, or
//   text that is not strict JSON (leading zeros, a trailing comma); the caller's typed decoder
//   then decides and words the error.
//
// event_columns(text) -> (item_ids, actions, timestamps) int64 [n] each, or None
//   `text` (bytes of one JSON value) read as the events form's history, an array of objects each
//   with exactly the keys "item_id", "action" and "timestamp" (any order) holding integers. None
//   for anything else (another key, a missing or repeated one, an escape in a key, another value
//   type, a value outside int64): the caller's typed decoder decides.
// The GIL stays held: each call takes microseconds (batch_features.cpp says why that matters).
#include <torch/extension.h>
#include <pybind11/numpy.h>

#include "kv_checks.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace hstu {
namespace {

using Ints = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Violation = std::tuple<int64_t, int64_t, int64_t>;

// Index of the first value outside [0, upper), or -1.
int64_t first_out_of_range(const Ints& values, int64_t upper) {
  const int64_t* v = values.data();
  const int64_t n = values.size();
  for (int64_t i = 0; i < n; ++i) {
    if (v[i] < 0 || v[i] >= upper) return i;
  }
  return -1;
}

Violation check_request(const Ints& item_ids, const Ints& actions, const Ints& timestamps, const Ints& candidates,
                        const Ints& contextual, int64_t num_items, int64_t num_actions,
                        int64_t num_contextual_features) {
  const std::pair<const Ints*, int64_t> ranges[] = {
      {&item_ids, num_items}, {&candidates, num_items}, {&actions, num_actions}, {&contextual, num_contextual_features}};
  for (int64_t field = 0; field < 4; ++field) {
    const auto& [values, upper] = ranges[field];
    const int64_t bad = first_out_of_range(*values, upper);
    if (bad >= 0) return {field + 1, bad, values->data()[bad]};
  }
  const int64_t* t = timestamps.data();
  const int64_t n = timestamps.size();
  for (int64_t i = 1; i < n; ++i) {
    if (t[i] < t[i - 1]) return {5, i, t[i]};
  }
  if (n > 0 && t[0] < 0) return {6, 0, t[0]};  // non-decreasing: the first is the smallest
  return {0, 0, 0};
}

py::array_t<int64_t> token_records(const Ints& contextual, const Ints& item_ids, const Ints& actions,
                                   const Ints& timestamps) {
  const int64_t C = contextual.size(), E = item_ids.size();
  require(actions.size() == E && timestamps.size() == E,
          "token_records: " + std::to_string(E) + " items but " + std::to_string(actions.size()) + " actions and " +
              std::to_string(timestamps.size()) + " timestamps");
  py::array_t<int64_t> out({C + 2 * E, int64_t{2}});
  int64_t* r = out.mutable_data();
  const int64_t *ctx = contextual.data(), *items = item_ids.data(), *acts = actions.data(), *t = timestamps.data();
  for (int64_t c = 0; c < C; ++c, r += 2) {
    r[0] = ctx[c];
    r[1] = 0;
  }
  for (int64_t e = 0; e < E; ++e, r += 4) {
    r[0] = items[e];
    r[1] = t[e];
    r[2] = acts[e];
    r[3] = t[e];
  }
  return out;
}

bool same_bytes(const py::buffer& a, const py::buffer& b, int64_t start, int64_t stop) {
  const py::buffer_info x = a.request(), y = b.request();
  const auto contiguous_bytes = [](const py::buffer_info& info) {
    int64_t expected = info.itemsize;
    for (int64_t d = info.ndim - 1; d >= 0; --d) {
      if (info.shape[d] != 1 && info.strides[d] != expected) return int64_t{-1};
      expected *= info.shape[d];
    }
    return info.size * info.itemsize;
  };
  const int64_t nx = contiguous_bytes(x), ny = contiguous_bytes(y);
  require(nx >= 0 && ny >= 0, "same_bytes: both buffers must be contiguous");
  require(0 <= start && start <= stop && stop <= nx && stop <= ny,
          "same_bytes: bytes [" + std::to_string(start) + ", " + std::to_string(stop) + ") outside buffers of " +
              std::to_string(nx) + " and " + std::to_string(ny) + " bytes");
  return std::memcmp(static_cast<const char*>(x.ptr) + start, static_cast<const char*>(y.ptr) + start,
                     static_cast<size_t>(stop - start)) == 0;
}

bool json_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool digit(char c) { return c >= '0' && c <= '9'; }

// A cursor over one JSON text; every reader returns false where the text is not what it expects.
struct JsonCursor {
  const char* p;
  const char* end;

  void skip() {
    while (p < end && json_space(*p)) ++p;
  }
  bool take(char c) {  // c, then whitespace
    if (p == end || *p != c) return false;
    ++p;
    skip();
    return true;
  }
  bool integer(int64_t& out) {  // a JSON integer within int64, then whitespace
    const bool negative = p < end && *p == '-';
    if (negative) ++p;
    if (p == end || !digit(*p)) return false;
    if (*p == '0' && p + 1 < end && digit(p[1])) return false;  // a leading zero: not JSON
    const uint64_t limit = negative ? uint64_t{1} << 63 : (uint64_t{1} << 63) - 1;
    uint64_t v = 0;
    for (; p < end && digit(*p); ++p) {
      const uint64_t d = static_cast<uint64_t>(*p - '0');
      if (v > (limit - d) / 10) return false;  // outside int64
      v = v * 10 + d;
    }
    out = negative ? static_cast<int64_t>(0 - v) : static_cast<int64_t>(v);
    skip();
    return true;
  }
  bool key(std::string_view& out) {  // a member name without escapes, its colon, whitespace
    if (p == end || *p != '"') return false;
    const char* start = ++p;
    while (p < end && *p != '"' && *p != '\\') ++p;
    if (p == end || *p != '"') return false;
    out = std::string_view(start, static_cast<size_t>(p - start));
    ++p;
    skip();
    return take(':');
  }
  // '[' item (',' item)* ']' or '[' ']': item() reads one element
  template <typename Item>
  bool array(Item item) {
    if (!take('[')) return false;
    if (take(']')) return true;
    for (;;) {
      if (!item()) return false;
      if (take(',')) continue;
      return take(']');
    }
  }
  bool done() {
    skip();
    return p == end;
  }
};

JsonCursor cursor_of(const py::bytes& text) {
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(text.ptr(), &data, &size) != 0) throw py::error_already_set();
  JsonCursor c{data, data + size};
  c.skip();
  return c;
}

py::array_t<int64_t> to_array(const std::vector<int64_t>& values) {
  py::array_t<int64_t> out(static_cast<py::ssize_t>(values.size()));
  std::copy(values.begin(), values.end(), out.mutable_data());
  return out;
}

py::object int_array(const py::bytes& text) {
  JsonCursor c = cursor_of(text);
  std::vector<int64_t> values;
  values.reserve(static_cast<size_t>(c.end - c.p) / 2);
  const bool ok = c.array([&] {
    int64_t v;
    if (!c.integer(v)) return false;
    values.push_back(v);
    return true;
  });
  if (!ok || !c.done()) return py::none();
  return to_array(values);
}

py::object event_columns(const py::bytes& text) {
  JsonCursor c = cursor_of(text);
  std::vector<int64_t> columns[3];  // item_id, action, timestamp
  const bool ok = c.array([&] {
    if (!c.take('{')) return false;
    int64_t values[3];
    bool seen[3] = {false, false, false};
    for (int member = 0; member < 3; ++member) {
      std::string_view name;
      if (member > 0 && !c.take(',')) return false;
      if (!c.key(name)) return false;
      const int field = name == "item_id" ? 0 : name == "action" ? 1 : name == "timestamp" ? 2 : -1;
      if (field < 0 || seen[field] || !c.integer(values[field])) return false;
      seen[field] = true;
    }
    if (!c.take('}')) return false;  // (three distinct known keys were read: each exactly once)
    for (int f = 0; f < 3; ++f) columns[f].push_back(values[f]);
    return true;
  });
  if (!ok || !c.done()) return py::none();
  return py::make_tuple(to_array(columns[0]), to_array(columns[1]), to_array(columns[2]));
}

}  // namespace

void bind_request_checks(py::module& m) {
  m.def("check_request", &check_request, py::arg("item_ids"), py::arg("actions"), py::arg("timestamps"),
        py::arg("candidates"), py::arg("contextual"), py::arg("num_items"), py::arg("num_actions"),
        py::arg("num_contextual_features"),
        "(field, index, value) of a request's first out-of-range value or timestamp going back "
        "(csrc/request_checks.cpp lists the fields); (0, 0, 0) when every value is valid.");
  m.def("token_records", &token_records, py::arg("contextual"), py::arg("item_ids"), py::arg("actions"),
        py::arg("timestamps"), "int64 [C + 2E, 2] identity records of one history (model/identity.py's layout).");
  m.def("same_bytes", &same_bytes, py::arg("a"), py::arg("b"), py::arg("start"), py::arg("stop"),
        "whether bytes [start, stop) of two contiguous buffers are equal (one memcmp, no copies).");
  m.def("int_array", &int_array, py::arg("text"),
        "bytes of a JSON array of integers -> int64 array; None for any other value or one outside int64.");
  m.def("event_columns", &event_columns, py::arg("text"),
        "bytes of the events form's history -> (item_ids, actions, timestamps) int64 arrays; None for anything else.");
}

}  // namespace hstu
