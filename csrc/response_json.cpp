// The rank response's "scores" array written in one pass (serving/responses.py ScoresEncoder).
//
// encode_scores(item_ids, probs, separators) -> bytes
//   [{"item_id":<id>,"scores":{<key 0>:<p 0>,<key 1>:<p 1>,...}},...] for item_ids int64 [M] and
//   probs float32 or float64 [M, K] (a task per column); separators[k] are the bytes written before
//   probability k, the task keys JSON-encoded once by the caller (',"scores":{"click":' first, then
//   ',"like":', ...). A probability is the shortest text that reads back to the same value of its
//   own type (std::to_chars: a float32 as float32, so 0.1f is "0.1" and not 0.10000000149011612),
//   always with a fraction or an exponent so that it parses as a float ("0.0", "1.0"); a non-finite
//   one is null, as msgspec writes it.
// Why: the Python encoder (msgspec per column, then list slicing) took ~75 us for 256 candidates x 3
// tasks on the dev CPU, on the front end's event loop for every answer; on the H100 host the
// server's "respond" phase was 0.32-0.35 ms at p50. The GIL stays held (microseconds).
#include <torch/extension.h>
#include <pybind11/numpy.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace py = pybind11;

namespace hstu {
namespace {

constexpr char kOpenFirst[] = "{\"item_id\":";
constexpr char kOpenNext[] = ",{\"item_id\":";
constexpr char kClose[] = "}}";

template <typename Float>
char* write_shortest(char* out, char* end, Float value) {
#if defined(__cpp_lib_to_chars) && __cpp_lib_to_chars >= 201611L
  return std::to_chars(out, end, value).ptr;
#else  // a standard library without floating-point to_chars (libstdc++ before GCC 11): enough digits
  // to read back exactly (9 for a float32, 17 for a double), not always the shortest
  const int n = std::snprintf(out, static_cast<size_t>(end - out), sizeof(Float) == 4 ? "%.9g" : "%.17g",
                              static_cast<double>(value));
  return out + n;
#endif
}

template <typename Float>
char* write_probability(char* out, char* end, Float value) {
  if (!std::isfinite(value)) {
    for (const char c : {'n', 'u', 'l', 'l'}) *out++ = c;
    return out;
  }
  char* start = out;
  out = write_shortest(out, end, value);
  bool floating = false;
  for (const char* p = start; p < out; ++p) floating |= (*p == '.' || *p == 'e');
  if (!floating) {  // an integral value ("0", "1"): written as a float, as msgspec does
    *out++ = '.';
    *out++ = '0';
  }
  return out;
}

template <typename Float>
py::bytes encode(const py::array_t<int64_t, py::array::c_style>& ids, const py::array& probs_any,
                 const std::vector<std::string>& separators) {
  const auto probs = py::array_t<Float, py::array::c_style>::ensure(probs_any);
  const int64_t m = ids.shape(0);
  const int64_t k = static_cast<int64_t>(separators.size());
  if (probs.ndim() != 2 || probs.shape(0) != m || probs.shape(1) != k) {
    throw std::invalid_argument("encode_scores: probs must be [len(item_ids), len(separators)]");
  }
  if (m == 0) return py::bytes("[]", 2);
  size_t separators_bytes = 0;
  for (const auto& s : separators) separators_bytes += s.size();
  // per candidate: opening, an int64 (20 chars + sign), separators, K numbers (at most 24 chars + ".0"),
  // the closing
  const size_t per_row = sizeof(kOpenNext) + 21 + separators_bytes + static_cast<size_t>(k) * 26 + sizeof(kClose);
  std::string text(2 + static_cast<size_t>(m) * per_row, '\0');
  char* out = text.data();
  char* const end = text.data() + text.size();
  const int64_t* id = ids.data();
  const Float* p = probs.data();
  *out++ = '[';
  for (int64_t row = 0; row < m; ++row) {
    const char* open = row ? kOpenNext : kOpenFirst;
    const size_t open_len = row ? sizeof(kOpenNext) - 1 : sizeof(kOpenFirst) - 1;
    out = std::copy(open, open + open_len, out);
    out = std::to_chars(out, end, id[row]).ptr;
    for (int64_t col = 0; col < k; ++col) {
      out = std::copy(separators[col].begin(), separators[col].end(), out);
      out = write_probability(out, end, p[row * k + col]);
    }
    out = std::copy(kClose, kClose + sizeof(kClose) - 1, out);
  }
  *out++ = ']';
  return py::bytes(text.data(), static_cast<size_t>(out - text.data()));
}

py::bytes encode_scores(const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& ids,
                        const py::array& probs, const std::vector<std::string>& separators) {
  if (ids.ndim() != 1) throw std::invalid_argument("encode_scores: item_ids must be one-dimensional");
  if (probs.dtype().is(py::dtype::of<float>())) return encode<float>(ids, probs, separators);
  return encode<double>(ids, probs, separators);
}

}  // namespace

void bind_response_json(py::module& m) {
  m.def("encode_scores", &encode_scores, py::arg("item_ids"), py::arg("probs"), py::arg("separators"),
        "The rank response's scores array as JSON bytes (csrc/response_json.cpp describes the layout).");
}

}  // namespace hstu
