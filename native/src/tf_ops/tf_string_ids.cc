// String ids as int64: TensorFlow's own 64-bit fingerprint (farmhash, exported by
// libtensorflow_framework) of each string of an Arrow string column, modulo 2^63 - 1. The same
// value as tf.strings.to_hash_bucket_fast(s, 2**63 - 1), so a serving graph that receives the
// strings hashes them with a stock op, and every rank hashes alike whatever its machine.
// C functions over Arrow's own buffers (offsets and bytes), called with ctypes once per column
// chunk: no Python object per string (rank_runtime/input/columns.py).
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
}  // namespace

extern "C" {
// offsets: n + 1 entries into data (Arrow's string and binary layout); out: n ids.
void shardrec_hash_strings32(const int32_t* offsets, const char* data, int64_t n, int64_t* out) {
  HashAll(offsets, data, n, out);
}
// Arrow's large_string and large_binary layout.
void shardrec_hash_strings64(const int64_t* offsets, const char* data, int64_t n, int64_t* out) {
  HashAll(offsets, data, n, out);
}
}
