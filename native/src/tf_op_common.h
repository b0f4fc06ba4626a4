// What the op library's kernels share: running a loop over rows on TensorFlow's intra-op pool, and
// registering a kernel for both index types.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>

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
// true when all are inside.
template <typename Flat>
bool IndicesInside(tensorflow::OpKernelContext* ctx, const Flat& idx, int64_t n, int64_t n_rows, const char* what,
                   const char* of = "the") {
  for (int64_t i = 0; i < n; ++i) {
    if (idx(i) < 0 || idx(i) >= n_rows) {
      ctx->SetStatus(tensorflow::errors::InvalidArgument(what, " ", idx(i), " at ", i, " is outside ", of, " ", n_rows,
                                                         " rows"));
      return false;
    }
  }
  return true;
}

// dst[i] = src[idx(i)] for rows of `dim` floats, in parallel, asking for a later row's lines early
// (the rows are scattered over `src`).
template <typename Flat>
void GatherRows(tensorflow::OpKernelContext* ctx, const float* src, const Flat& idx, int64_t n, int64_t dim,
                float* dst) {
  const size_t bytes = dim * sizeof(float);
  ParallelRows(ctx, n, 4 * dim, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kPrefetchAhead < end) __builtin_prefetch(src + static_cast<int64_t>(idx(i + kPrefetchAhead)) * dim);
      std::memcpy(dst + i * dim, src + static_cast<int64_t>(idx(i)) * dim, bytes);
    }
  });
}

}  // namespace shardrec

// KERNEL<int32_t> and KERNEL<int64_t> for op NAME, by its index type attribute ATTR.
#define SHARDREC_REGISTER_BY_INDEX(NAME, ATTR, KERNEL)                                                         \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(tensorflow::DEVICE_CPU).TypeConstraint<int32_t>(ATTR), KERNEL<int32_t>); \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(tensorflow::DEVICE_CPU).TypeConstraint<int64_t>(ATTR), KERNEL<int64_t>)
