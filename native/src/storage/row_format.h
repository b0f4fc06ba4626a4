// How a column of a row store holds its numbers: float32, or 16 bits (IEEE float16 or bfloat16) to
// halve a table's memory. Arithmetic is always float32: a 16-bit row is widened when it is read
// (a lookup's gather, a save, an optimizer's update) and narrowed when it is written, either to the
// nearest 16-bit value (restores, initial values: exact for rows that were 16-bit already) or, for
// an optimizer's update, stochastically: up with probability equal to the distance from the value
// below, so that updates smaller than half a 16-bit step are not all lost (they are on average kept).
//
// The conversions are written out, and float16's also taken from F16C where the CPU has it (chosen
// at run time: the project builds for AVX, TensorFlow's own requirement, which does not imply F16C).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace shardrec {

enum class RowFormat : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline RowFormat checked_format(int32_t f) {
  if (f < 0 || f > 2) throw std::invalid_argument("row format " + std::to_string(f) + " is not 0 (float32), 1 "
                                                  "(float16) or 2 (bfloat16)");
  return static_cast<RowFormat>(f);
}

inline int64_t element_bytes(RowFormat f) { return f == RowFormat::kFloat32 ? 4 : 2; }

// The dtype a checkpoint's manifest gives a column's file: numpy's own for float32 and float16;
// bfloat16, which numpy lacks, is written as its raw 16 bits (an .npy of '<u2') and named so.
inline const char* manifest_dtype(RowFormat f) {
  return f == RowFormat::kFloat32 ? "<f4" : f == RowFormat::kFloat16 ? "<f2" : "bfloat16";
}
inline const char* npy_descr(RowFormat f) { return f == RowFormat::kBFloat16 ? "<u2" : manifest_dtype(f); }

namespace row_format {

inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t magnitude = h & 0x7fffu;
  uint32_t out;
  if (magnitude >= 0x7c00u) {
    out = 0x7f800000u | (magnitude & 0x3ffu) << 13;  // inf, nan (payload kept)
  } else if (magnitude >= 0x0400u) {
    out = (magnitude << 13) + ((127 - 15) << 23);  // normal: rebias the exponent
  } else {
    // Subnormal (or zero): its mantissa times 2^-24, exact in float32.
    const float v = static_cast<float>(magnitude) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return from_bits(out | sign);
}

// float32 -> float16, round to nearest even; beyond the largest half (65504) rounds to infinity.
inline uint16_t float_to_half(float f) {
  uint32_t u = bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) return sign | (u > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // rounds to beyond 65504
  if (u < 0x38800000u) {
    // Below the smallest normal half (2^-14): adding 0.5 makes the FPU round the mantissa for us.
    const float shifted = from_bits(u) + 0.5f;
    return sign | static_cast<uint16_t>(bits(shifted) - bits(0.5f));
  }
  const uint32_t odd = (u >> 13) & 1u;
  u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + odd;
  return sign | static_cast<uint16_t>(u >> 13);
}

inline float bf16_to_float(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // nan stays nan
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Stochastic rounding to float16. In float16's normal range a half keeps the top 10 of float32's 23
// mantissa bits: adding a uniform 13-bit number to the dropped ones and truncating carries into
// the kept ones with probability (dropped / 2^13), as for bfloat16 below. Below the smallest normal
// half (subnormal results), the two neighbours are compared in float32 instead.
// Outside float16's normal range: inf, nan and from the largest half (65504) on as to the nearest;
// below the smallest normal half, the two neighbours compared in float32.
__attribute__((noinline)) inline uint16_t stochastic_half_outside(float f, uint32_t random) {
  const uint32_t a = bits(f) & 0x7fffffffu;
  if (a >= 0x477fe000u) return float_to_half(f);
  uint16_t h = float_to_half(f);
  const float magnitude = from_bits(a);
  if (std::fabs(half_to_float(h)) > magnitude) --h;  // toward zero (the magnitude sits in the low 15 bits)
  const float below = std::fabs(half_to_float(h));
  if (below == magnitude) return h;
  const float above = std::fabs(half_to_float(static_cast<uint16_t>(h + 1)));
  const float fraction = (magnitude - below) / (above - below);
  return static_cast<float>(random & 0xffffu) * (1.0f / 65536.0f) < fraction ? static_cast<uint16_t>(h + 1) : h;
}

inline uint16_t stochastic_half(float f, uint32_t random) {
  const uint32_t u = bits(f);
  const uint32_t a = u & 0x7fffffffu;
  if (__builtin_expect(a - 0x38800000u >= 0x477fe000u - 0x38800000u, 0)) return stochastic_half_outside(f, random);
  const uint32_t carried = a + (random & 0x1fffu) - (static_cast<uint32_t>(127 - 15) << 23);
  return static_cast<uint16_t>(((u >> 16) & 0x8000u) | (carried >> 13));
}

inline uint16_t stochastic_bf16(float f, uint32_t random16) {
  const uint32_t u = bits(f);
  // The dropped 16 bits plus a uniform 16-bit number carry into the kept ones with probability
  // (dropped / 2^16): the magnitude's bits, so negative values round away from zero alike.
  const auto rounded = static_cast<uint16_t>((u + (random16 & 0xffffu)) >> 16);
  return (u & 0x7f800000u) == 0x7f800000u ? float_to_bf16(f) : rounded;  // inf, nan as they are
}

inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// F16C's conversions, 8 numbers an instruction, on the CPUs that have them (every x86-64 CPU since
// 2012; the project builds for AVX, which does not imply them, so they are chosen at run time). Its
// rounding is the same nearest-even as float_to_half's (the test of the conversions checks both).
#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) inline void half_to_float_f16c(const uint16_t* h, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j))));
  for (; j < n; ++j) out[j] = half_to_float(h[j]);
}
__attribute__((target("avx,f16c"))) inline void float_to_half_f16c(const float* in, int64_t n, uint16_t* h) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + j), _mm256_cvtps_ph(_mm256_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT));
  for (; j < n; ++j) h[j] = float_to_half(in[j]);
}
inline bool has_f16c() {
  static const bool has = __builtin_cpu_supports("f16c");
  return has;
}
#else
inline void half_to_float_f16c(const uint16_t* h, int64_t n, float* out) {
  for (int64_t j = 0; j < n; ++j) out[j] = half_to_float(h[j]);
}
inline void float_to_half_f16c(const float* in, int64_t n, uint16_t* h) {
  for (int64_t j = 0; j < n; ++j) h[j] = float_to_half(in[j]);
}
inline bool has_f16c() { return false; }
#endif

}  // namespace row_format

// n numbers of format `f` at `src` as float32 at `out`.
inline void widen(const void* src, RowFormat f, int64_t n, float* out) {
  if (f == RowFormat::kFloat32) {
    std::memcpy(out, src, n * 4);
    return;
  }
  const auto* h = static_cast<const uint16_t*>(src);
  if (f == RowFormat::kFloat16 && row_format::has_f16c())
    row_format::half_to_float_f16c(h, n, out);
  else if (f == RowFormat::kFloat16)
    for (int64_t j = 0; j < n; ++j) out[j] = row_format::half_to_float(h[j]);
  else
    for (int64_t j = 0; j < n; ++j) out[j] = row_format::bf16_to_float(h[j]);
}

// n float32 numbers at `in` to format `f` at `dst`, each to the nearest.
inline void narrow_nearest(const float* in, int64_t n, RowFormat f, void* dst) {
  if (f == RowFormat::kFloat32) {
    std::memcpy(dst, in, n * 4);
    return;
  }
  auto* h = static_cast<uint16_t*>(dst);
  if (f == RowFormat::kFloat16 && row_format::has_f16c())
    row_format::float_to_half_f16c(in, n, h);
  else if (f == RowFormat::kFloat16)
    for (int64_t j = 0; j < n; ++j) h[j] = row_format::float_to_half(in[j]);
  else
    for (int64_t j = 0; j < n; ++j) h[j] = row_format::float_to_bf16(in[j]);
}

// n float32 numbers at `in` to format `f` at `dst`, stochastically. The random numbers are a hash of
// `seed` (the training step and the column), the numbers' place in the row and the float32 numbers
// themselves: reproducible run to run, and the same whichever row, rank or rank count holds the key.
// A 32-bit multiplicative hash a number (its top 16 bits), the row's seed mixed once: a 64-bit mix
// for each number cost 2.1 ns, more than the update itself (SGD: 88 against 25 ns a row of 16).
inline uint32_t random16(uint32_t base, int64_t j, float value) {
  uint32_t z = (base + 0x9e3779b9u * static_cast<uint32_t>(j + 1)) ^ row_format::bits(value);
  z *= 0x85ebca6bu;
  z ^= z >> 15;
  z *= 0xc2b2ae35u;
  return z >> 16;
}

// Branch-free over the row (the compiler vectorises it); a row with a number outside float16's
// normal range, which the bit arithmetic does not hold, again one by one.
inline void narrow_stochastic_half(const float* __restrict in, int64_t n, uint16_t* __restrict h, uint32_t base) {
  uint32_t outside = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t u = row_format::bits(in[j]);
    const uint32_t a = u & 0x7fffffffu;
    outside |= static_cast<uint32_t>(a - 0x38800000u >= 0x477fe000u - 0x38800000u);
    const uint32_t carried = a + (random16(base, j, in[j]) & 0x1fffu) - (static_cast<uint32_t>(127 - 15) << 23);
    h[j] = static_cast<uint16_t>(((u >> 16) & 0x8000u) | ((carried >> 13) & 0x7fffu));
  }
  if (outside == 0) return;
  for (int64_t j = 0; j < n; ++j) h[j] = row_format::stochastic_half(in[j], random16(base, j, in[j]));
}

inline void narrow_stochastic_bf16(const float* __restrict in, int64_t n, uint16_t* __restrict h, uint32_t base) {
  for (int64_t j = 0; j < n; ++j) h[j] = row_format::stochastic_bf16(in[j], random16(base, j, in[j]));
}

inline void narrow_stochastic(const float* in, int64_t n, RowFormat f, void* dst, uint64_t seed) {
  const auto base = static_cast<uint32_t>(row_format::mix(seed));
  if (f == RowFormat::kFloat32)
    std::memcpy(dst, in, n * 4);
  else if (f == RowFormat::kFloat16)
    narrow_stochastic_half(in, n, static_cast<uint16_t*>(dst), base);
  else
    narrow_stochastic_bf16(in, n, static_cast<uint16_t*>(dst), base);
}

}  // namespace shardrec
