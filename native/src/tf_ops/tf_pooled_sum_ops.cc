// The sums of a pooled lookup (rank_runtime/pipeline/pooled_lookup.py) in one pass:
//   out[segments[i]] += weights[i] * rows[index[i]]
// The owner uses it to add the rows it holds for each (example, requester) into one partial, the
// requester to add an example's partials. Gather, weighting and segment sum as TensorFlow ops would
// write two intermediates of one row per id; here each id's row is read once and added in place.
// Its gradient is the same op with `index` and `segments` swapped (the rows of each id get their
// weight times their segment's gradient), so one kernel serves both directions.
//
// An empty `index` or `segments` stands for the identity (i), which saves the requester a range
// vector. Work is split over output rows: each worker scans the positions for the segments in its
// range, so no two workers add into one row and sums run in position order, as TensorFlow's.
#include <cstring>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tf_ops/tf_op_common.h"

namespace shardrec {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;

class PooledSumOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows = ctx->input(0);
    const Tensor& index = ctx->input(1);
    const Tensor& segments = ctx->input(2);
    const int64_t n_out = ctx->input(3).scalar<int32_t>()();
    const Tensor& weights = ctx->input(4);
    OP_REQUIRES(ctx, rows.dims() == 2, InvalidArgument("rows must be 2-D, got ", rows.shape().DebugString()));
    OP_REQUIRES(ctx, index.dims() == 1 && segments.dims() == 1 && weights.dims() == 1,
                InvalidArgument("index, segments and weights must be 1-D"));
    OP_REQUIRES(ctx, n_out >= 0, InvalidArgument("num_segments must be >= 0, got ", n_out));
    const int64_t n_rows = rows.dim_size(0), dim = rows.dim_size(1);
    Tensor* out = nullptr;
    if (n_out == 0 && index.NumElements() == 0 && segments.NumElements() == 0) {
      // No partial to make (an owner no id reached): not the identity, whose rows would have nowhere
      // to go (with static shapes such an owner still holds the padding's row).
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({0, dim}), &out));
      return;
    }
    const int64_t n = index.NumElements() > 0 ? index.NumElements() : segments.NumElements() > 0
                                                                        ? segments.NumElements()
                                                                        : n_rows;
    for (const Tensor* t : {&index, &segments, &weights})
      OP_REQUIRES(ctx, t->NumElements() == 0 || t->NumElements() == n,
                  InvalidArgument("index, segments and weights must have one entry per position (", n,
                                  ") or none, got ", t->NumElements()));
    auto idx = index.flat<int32_t>();
    auto seg = segments.flat<int32_t>();
    if (index.NumElements() > 0 && !IndicesInside(ctx, idx, n, n_rows, "index")) return;
    if (index.NumElements() == 0) OP_REQUIRES(ctx, n <= n_rows, InvalidArgument(n, " positions, ", n_rows, " rows"));
    if (segments.NumElements() > 0 && !IndicesInside(ctx, seg, n, n_out, "segment")) return;
    if (segments.NumElements() == 0)
      OP_REQUIRES(ctx, n <= n_out, InvalidArgument(n, " positions, ", n_out, " segments"));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n_out, dim}), &out));
    const float* src = rows.flat<float>().data();
    const float* w = weights.NumElements() > 0 ? weights.flat<float>().data() : nullptr;
    const int32_t* ix = index.NumElements() > 0 ? idx.data() : nullptr;
    const int32_t* sg = segments.NumElements() > 0 ? seg.data() : nullptr;
    float* dst = out->flat<float>().data();
    const int64_t cost = dim + std::max<int64_t>(1, n / std::max<int64_t>(1, n_out)) * (dim + 4);
    ParallelRows(ctx, n_out, cost, [&](int64_t begin, int64_t end) {
      std::memset(dst + begin * dim, 0, (end - begin) * dim * sizeof(float));
      for (int64_t i = 0; i < n; ++i) {
        const int64_t s = sg != nullptr ? sg[i] : i;
        if (s < begin || s >= end) continue;
        float* __restrict d = dst + s * dim;
        const float* __restrict r = src + (ix != nullptr ? ix[i] : i) * dim;
        if (w == nullptr) {
          for (int64_t j = 0; j < dim; ++j) d[j] += r[j];
        } else {
          const float f = w[i];
          for (int64_t j = 0; j < dim; ++j) d[j] += f * r[j];
        }
      }
    });
  }
};

}  // namespace

REGISTER_OP("ShardrecPooledSum")
    .Input("rows: float")
    .Input("index: int32")
    .Input("segments: int32")
    .Input("num_segments: int32")
    .Input("weights: float")
    .Output("out: float")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      tensorflow::shape_inference::ShapeHandle rows;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &rows));
      tensorflow::shape_inference::DimensionHandle n;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(3, &n));
      c->set_output(0, c->Matrix(n, c->Dim(rows, 1)));
      return tensorflow::OkStatus();
    })
    .Doc("out[segments[i]] += weights[i] * rows[index[i]]; an empty index, segments or weights is the "
         "identity (ones for weights).");

REGISTER_KERNEL_BUILDER(Name("ShardrecPooledSum").Device(tensorflow::DEVICE_CPU), shardrec::PooledSumOp);

}  // namespace shardrec
