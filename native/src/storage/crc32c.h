// CRC-32C (Castagnoli), the checksum of TFRecord framing, masked as TFRecord stores it. The SSE4.2
// instruction where the CPU has it (checked once at run time: 8 bytes a cycle or so), else a table
// of 256 entries; the two give the same value. A Redis stream's packed entries (tfrecord_framing.h)
// are checked with it as they are read, as TensorFlow's reader checks a file's records.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace shardrec {
namespace crc32c_detail {

constexpr uint32_t kPoly = 0x82f63b78u;  // reflected Castagnoli polynomial

inline const std::array<uint32_t, 256>& table() {
  static const std::array<uint32_t, 256> t = [] {
    std::array<uint32_t, 256> out{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
      out[i] = c;
    }
    return out;
  }();
  return t;
}

inline uint32_t by_table(uint32_t crc, const unsigned char* p, size_t n) {
  const auto& t = table();
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xffu] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) inline uint32_t by_instruction(uint32_t crc, const unsigned char* p, size_t n) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return c32;
}

inline bool has_instruction() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace crc32c_detail

inline uint32_t crc32c(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  if (crc32c_detail::has_instruction()) return ~crc32c_detail::by_instruction(~0u, p, n);
#endif
  return ~crc32c_detail::by_table(~0u, p, n);
}

// TFRecord stores rot15(crc) + a constant, so that a CRC over data holding CRCs stays strong.
inline uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t crc = crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

}  // namespace shardrec
