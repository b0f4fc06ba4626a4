// What the op library's kernels share: running a loop over rows on TensorFlow's intra-op pool, and
// registering a kernel for both index types.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/util/work_sharder.h"

namespace shardrec {

// How many rows ahead a loop over scattered table rows asks for their cache lines.
constexpr int64_t kPrefetchAhead = 16;

// work(begin, end) over [0, total) on the kernel's CPU worker pool; `cost` per item, in TensorFlow's
// units (about one per float touched), decides how finely it is split.
inline void ParallelRows(tensorflow::OpKernelContext* ctx, int64_t total, int64_t cost,
                         const std::function<void(int64_t, int64_t)>& work) {
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
  tensorflow::Shard(pool->num_threads, pool->workers, total, std::max<int64_t>(1, cost), work);
}

// Fails the kernel naming the first index outside [0, n_rows) ("<what> I at P is outside <of> N rows");
// true when all are inside. The common case (all inside) is one branch-free min/max pass, which the
// compiler vectorises: an early-exit loop ran at about one index per ns (3% of a dim-16 SGD step).
template <typename Flat>
bool IndicesInside(tensorflow::OpKernelContext* ctx, const Flat& idx, int64_t n, int64_t n_rows, const char* what,
                   const char* of = "the") {
  using Index = std::remove_cv_t<std::remove_reference_t<decltype(idx(0))>>;
  const Index* data = idx.data();
  Index lo = 0, hi = 0;
  if (n > 0) lo = hi = data[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, data[i]);
    hi = std::max(hi, data[i]);
  }
  if (n == 0 || (lo >= 0 && static_cast<int64_t>(hi) < n_rows)) return true;
  for (int64_t i = 0; i < n; ++i) {
    if (data[i] < 0 || data[i] >= n_rows) {
      ctx->SetStatus(tensorflow::errors::InvalidArgument(what, " ", data[i], " at ", i, " is outside ", of, " ",
                                                         n_rows, " rows"));
      return false;
    }
  }
  return true;
}

// Copies one row of DIM floats with the width known to the compiler: inline vector moves, where
// memcpy of a run-time length is a library call per row (the gathers' largest cost at dim 16).
template <int64_t DIM>
inline void CopyRow(float* __restrict dst, const float* __restrict src) {
  for (int64_t j = 0; j < DIM; ++j) dst[j] = src[j];
}

template <int64_t DIM, typename Flat>
void GatherRowsOf(const float* src, const Flat& idx, int64_t begin, int64_t end, int64_t dim, float* dst) {
  for (int64_t i = begin; i < end; ++i) {
    if (i + kPrefetchAhead < end) __builtin_prefetch(src + static_cast<int64_t>(idx(i + kPrefetchAhead)) * dim);
    if constexpr (DIM > 0)
      CopyRow<DIM>(dst + i * DIM, src + static_cast<int64_t>(idx(i)) * DIM);
    else
      std::memcpy(dst + i * dim, src + static_cast<int64_t>(idx(i)) * dim, dim * sizeof(float));
  }
}

// dst[i] = src[idx(i)] for rows of `dim` floats, in parallel, asking for a later row's lines early
// (the rows are scattered over `src`).
template <typename Flat>
void GatherRows(tensorflow::OpKernelContext* ctx, const float* src, const Flat& idx, int64_t n, int64_t dim,
                float* dst) {
  ParallelRows(ctx, n, 4 * dim, [&](int64_t begin, int64_t end) {
    switch (dim) {
      case 8: return GatherRowsOf<8>(src, idx, begin, end, dim, dst);
      case 16: return GatherRowsOf<16>(src, idx, begin, end, dim, dst);
      case 32: return GatherRowsOf<32>(src, idx, begin, end, dim, dst);
      case 64: return GatherRowsOf<64>(src, idx, begin, end, dim, dst);
      case 128: return GatherRowsOf<128>(src, idx, begin, end, dim, dst);
      default: return GatherRowsOf<0>(src, idx, begin, end, dim, dst);
    }
  });
}

}  // namespace shardrec

// KERNEL<int32_t> and KERNEL<int64_t> for op NAME, by its index type attribute ATTR.
#define SHARDREC_REGISTER_BY_INDEX(NAME, ATTR, KERNEL)                                                         \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(tensorflow::DEVICE_CPU).TypeConstraint<int32_t>(ATTR), KERNEL<int32_t>); \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(tensorflow::DEVICE_CPU).TypeConstraint<int64_t>(ATTR), KERNEL<int64_t>)
