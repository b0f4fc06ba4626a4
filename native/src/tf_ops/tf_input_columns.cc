// Parquet columns into a batch's arrays, natively (rank_runtime/input/columns.py calls these with
// ctypes over Arrow's own buffers: no Python object per value).
//
// String ids as int64: TensorFlow's own 64-bit fingerprint (farmhash, exported by
// libtensorflow_framework) of each string of an Arrow string column, modulo 2^63 - 1. The same
// value as tf.strings.to_hash_bucket_fast(s, 2**63 - 1), so a serving graph that receives the
// strings hashes them with a stock op, and every rank hashes alike whatever its machine.
//
// A group's scalar columns stacked as one row-major [rows, k] array (Criteo's 26 id columns as
// one tensor), a row at a time: the output is written in order and each column read in order.
// Measured on a row group of 26 x 16384 int64 not in cache: 1.2 ns an id, against 2.2 for blocks
// of 64 rows a column at a time and about 3 for numpy's column-by-column assignment.
#include <cstddef>
#include <cstdint>

namespace farmhashna {
uint64_t Hash64(const char* s, size_t len);
}

namespace {
constexpr uint64_t kBuckets = (uint64_t{1} << 63) - 1;

template <typename Offset>
void HashAll(const Offset* offsets, const char* data, int64_t n, int64_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const Offset begin = offsets[i];
    out[i] = static_cast<int64_t>(farmhashna::Hash64(data + begin, static_cast<size_t>(offsets[i + 1] - begin)) %
                                  kBuckets);
  }
}
template <typename T>
void Interleave(const T* const* columns, int64_t k, int64_t rows, T* out) {
  for (int64_t r = 0; r < rows; ++r, out += k) {
    for (int64_t c = 0; c < k; ++c) out[c] = columns[c][r];
  }
}
}  // namespace

extern "C" {
// columns: k pointers to `rows` values each, of `itemsize` bytes (4 or 8); out: rows * k values,
// row-major. Returns 0, or -1 for another itemsize.
int shardrec_stack_columns(const void* const* columns, int64_t k, int64_t rows, int64_t itemsize, void* out) {
  if (itemsize == 8) {
    Interleave(reinterpret_cast<const int64_t* const*>(columns), k, rows, static_cast<int64_t*>(out));
  } else if (itemsize == 4) {
    Interleave(reinterpret_cast<const int32_t* const*>(columns), k, rows, static_cast<int32_t*>(out));
  } else {
    return -1;
  }
  return 0;
}

// offsets: n + 1 entries into data (Arrow's string and binary layout); out: n ids.
void shardrec_hash_strings32(const int32_t* offsets, const char* data, int64_t n, int64_t* out) {
  HashAll(offsets, data, n, out);
}
// Arrow's large_string and large_binary layout.
void shardrec_hash_strings64(const int64_t* offsets, const char* data, int64_t n, int64_t* out) {
  HashAll(offsets, data, n, out);
}
}
