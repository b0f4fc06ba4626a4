// What the lookup's kernels share around a table variable: reading it under its lock, gathering its
// rows as float32 whatever their format, and summing the gradients of positions into rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tf_ops/tf_op_common.h"
#include "tf_ops/tf_row_store.h"

namespace shardrec {

// Position i's row: idx(expand(i)), the row of the table that position i of an expanded gather reads.
template <typename Flat>
struct ThroughExpand {
  const Flat& rows;
  const typename tensorflow::TTypes<int32_t>::ConstFlat& expand;
  auto operator()(int64_t i) const { return rows(expand(i)); }
};

// dst[i] = table[idx(i)] as float32, for a float32, float16 or bfloat16 table, in parallel, reading ahead.
template <typename Flat>
void GatherTableRows(tensorflow::OpKernelContext* ctx, const tensorflow::Tensor& table, RowFormat format,
                     const Flat& idx, int64_t n, int64_t dim, float* dst) {
  if (format == RowFormat::kFloat32) return GatherRows(ctx, table.flat<float>().data(), idx, n, dim, dst);
  const auto* rows = static_cast<const uint16_t*>(table.data());
  ParallelRows(ctx, n, 4 * dim, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kPrefetchAhead < end) __builtin_prefetch(rows + static_cast<int64_t>(idx(i + kPrefetchAhead)) * dim);
      widen(rows + static_cast<int64_t>(idx(i)) * dim, format, dim, dst + i * dim);
    }
  });
}

// Runs read(table, format) with the table variable of input `input` locked shared, as TensorFlow's
// ResourceGather holds it: an update of the table (exclusive) never interleaves with the read.
// False (the kernel failed, saying why) for a variable that is not a 2-D float table.
inline bool ReadTable(tensorflow::OpKernelContext* ctx, int input,
                      const std::function<void(const tensorflow::Tensor&, RowFormat)>& read) {
  tensorflow::core::RefCountPtr<tensorflow::Var> var;
  auto status = tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, input), &var);
  if (!status.ok()) {
    ctx->SetStatus(status);
    return false;
  }
  tensorflow::tf_shared_lock lock(*var->mu());
  const tensorflow::Tensor& table = *var->tensor();
  RowFormat format;
  if (!table.IsInitialized() || table.dims() != 2 || !FormatOf(table.dtype(), &format)) {
    ctx->SetStatus(tensorflow::errors::InvalidArgument(
        table.IsInitialized() ? "the table must be a 2-D float32, float16 or bfloat16 variable, got " +
                                    tensorflow::DataTypeString(table.dtype()) + table.shape().DebugString()
                              : std::string("the table variable is not initialised")));
    return false;
  }
  read(table, format);
  return ctx->status().ok();
}

// Tells the table's row store that the key pipeline's batch `ticket` ([1] int32, 0: none) on
// `channel` has its rows read: the rows of earlier batches may then move to SSD.
inline void NoteGathered(const tensorflow::Tensor& table, const tensorflow::Tensor& ticket, Channel channel) {
  RowStore* store = StoreOfColumn(table);
  if (store != nullptr && ticket.NumElements() == 1 && ticket.flat<int32_t>()(0) > 0)
    store->note_gathered(channel, static_cast<uint32_t>(ticket.flat<int32_t>()(0)));
}

// dst[r] = sum of src(i) over the i in [0, n) with idx(i) == r, in order of i, for n_rows rows of
// `dim` floats. In parallel over rows: each worker takes a range of rows and scans the (small)
// index vector for the positions that fall in it, so no two workers add into the same row.
template <typename Flat, typename Source>
void SumRowsInto(tensorflow::OpKernelContext* ctx, const Flat& idx, int64_t n, const Source& src, int64_t n_rows,
                 int64_t dim, float* dst) {
  // Cost per row: its share of the scan of `idx`, plus its own sums.
  const int64_t cost = dim + std::max<int64_t>(1, n / std::max<int64_t>(1, n_rows)) * (dim + 4);
  ParallelRows(ctx, n_rows, cost, [&](int64_t begin, int64_t end) {
    std::memset(dst + begin * dim, 0, (end - begin) * dim * sizeof(float));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = idx(i);
      if (r < begin || r >= end) continue;
      float* __restrict d = dst + r * dim;
      const float* __restrict s = src(i);
      for (int64_t j = 0; j < dim; ++j) d[j] += s[j];
    }
  });
}

}  // namespace shardrec
