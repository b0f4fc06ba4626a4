// What the op library's kernels share: running a loop over rows on TensorFlow's intra-op pool, and
// registering a kernel for both index types.
#pragma once

#include <algorithm>
#include <cstdint>
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

}  // namespace shardrec

// KERNEL<int32_t> and KERNEL<int64_t> for op NAME, by its index type attribute ATTR.
#define SHARDREC_REGISTER_BY_INDEX(NAME, ATTR, KERNEL)                                                         \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(tensorflow::DEVICE_CPU).TypeConstraint<int32_t>(ATTR), KERNEL<int32_t>); \
  REGISTER_KERNEL_BUILDER(Name(NAME).Device(tensorflow::DEVICE_CPU).TypeConstraint<int64_t>(ATTR), KERNEL<int64_t>)
