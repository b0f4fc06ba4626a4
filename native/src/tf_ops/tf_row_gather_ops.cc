// Row gathers of a lookup (TensorFlow custom ops, in the same op library as the fused sparse-apply
// kernels): batch order from distinct rows (`restore`), and the rows a rank asked for from the
// rows it owns (`expand`). Their gradient sums the gradients of a row that several positions read.
//
// TensorFlow's GatherV2 + UnsortedSegmentSum do the same, but its segment sum runs on one thread
// with a generic inner loop; it was the largest op of a dim-16 lazy Adam step (2.3 ms of 8.8).
// Here both directions run in parallel over output rows: the gradient gives each worker a range of
// distinct rows, and each worker scans the (small) index vector for the positions that fall in it,
// so no two workers add into the same row and the sums are in position order, as TensorFlow's.
#include <cstring>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tf_ops/tf_op_common.h"
#include "tf_ops/tf_table_rows.h"

namespace shardrec {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
namespace shape_inference = tensorflow::shape_inference;

template <typename Index>
class RowGatherOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows = ctx->input(0);
    const Tensor& index = ctx->input(1);
    OP_REQUIRES(ctx, rows.dims() == 2, InvalidArgument("rows must be 2-D, got ", rows.shape().DebugString()));
    OP_REQUIRES(ctx, index.dims() == 1, InvalidArgument("index must be 1-D, got ", index.shape().DebugString()));
    const int64_t n_rows = rows.dim_size(0), dim = rows.dim_size(1), n = index.dim_size(0);
    auto idx = index.flat<Index>();
    if (!IndicesInside(ctx, idx, n, n_rows, "index")) return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &out));
    GatherRows(ctx, rows.flat<float>().data(), idx, n, dim, out->flat<float>().data());
  }
};

template <typename Index>
class RowGatherGradOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    const Tensor& index = ctx->input(1);
    // num_rows: a scalar, or the rows' shape (its first element), which saves a graph the slice of
    // it per lookup (four ops a table of a wide model).
    const Tensor& num_rows = ctx->input(2);
    OP_REQUIRES(ctx, num_rows.dims() <= 1 && num_rows.NumElements() >= 1,
                InvalidArgument("num_rows must be a scalar or a shape, got ", num_rows.shape().DebugString()));
    const int64_t n_rows = num_rows.flat<int32_t>()(0);
    OP_REQUIRES(ctx, grad.dims() == 2 && index.dims() == 1 && grad.dim_size(0) == index.dim_size(0),
                InvalidArgument("grad ", grad.shape().DebugString(), " and index ", index.shape().DebugString(),
                                " do not match"));
    OP_REQUIRES(ctx, n_rows >= 0, InvalidArgument("num_rows must be >= 0, got ", n_rows));
    const int64_t n = index.dim_size(0), dim = grad.dim_size(1);
    auto idx = index.flat<Index>();
    if (!IndicesInside(ctx, idx, n, n_rows, "index")) return;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n_rows, dim}), &out));
    const float* g = grad.flat<float>().data();
    SumRowsInto(ctx, idx, n, [g, dim](int64_t i) { return g + i * dim; }, n_rows, dim, out->flat<float>().data());
  }
};

// The rows of a lookup, read from the table variable: rows scattered over the whole table, so a
// later row is prefetched while this one is copied (TensorFlow's ResourceGather does one row after
// another and waits for each). Holds the variable's lock shared, as ResourceGather does: an update
// of the table (exclusive) never interleaves with it. Reports the batch's ticket to the table's row
// store once its rows are read: the rows of earlier batches may then move to SSD.
//
// EXPANDED: out[i] = table[index[expand[i]]], the rows each requester asked for straight from the
// table, where a gather of the distinct rows then a gather of those through `expand` wrote and read
// every row once more (dim 16: 0.74 against 0.58 ms for 43k rows; dim 128: 6.4 against 4.6 ms).
template <typename Index, bool EXPANDED>
class VariableRowGatherOp : public OpKernel {
 public:
  explicit VariableRowGatherOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int64_t channel = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("channel", &channel));
    OP_REQUIRES(ctx, channel == 0 || channel == 1,
                InvalidArgument("channel must be 0 (train) or 1 (eval), got ", channel));
    channel_ = static_cast<Channel>(channel);
  }
  void Compute(OpKernelContext* ctx) override {
    const Tensor& index = ctx->input(1);
    OP_REQUIRES(ctx, index.dims() == 1, InvalidArgument("index must be 1-D, got ", index.shape().DebugString()));
    auto idx = index.flat<Index>();
    ReadTable(ctx, 0, [&](const Tensor& table, RowFormat format) {
      const int64_t dim = table.dim_size(1);
      if (!IndicesInside(ctx, idx, index.dim_size(0), table.dim_size(0), "row", "the table's")) return;
      if constexpr (EXPANDED) {
        const Tensor& expand = ctx->input(2);
        OP_REQUIRES(ctx, expand.dims() == 1,
                    InvalidArgument("expand must be 1-D, got ", expand.shape().DebugString()));
        auto through = expand.flat<int32_t>();
        if (!IndicesInside(ctx, through, expand.dim_size(0), index.dim_size(0), "expand", "the index's")) return;
        gather(ctx, table, format, ThroughExpand<decltype(idx)>{idx, through}, expand.dim_size(0), dim);
      } else {
        gather(ctx, table, format, idx, index.dim_size(0), dim);
      }
      NoteGathered(table, ctx->input(EXPANDED ? 3 : 2), channel_);
    });
  }

 private:
  template <typename Rows>
  void gather(OpKernelContext* ctx, const Tensor& table, RowFormat format, const Rows& rows, int64_t n, int64_t dim) {
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n, dim}), &out));
    GatherTableRows(ctx, table, format, rows, n, dim, out->flat<float>().data());
  }

  Channel channel_ = Channel::kTrain;
};

template <typename Index>
using DistinctRowGatherOp = VariableRowGatherOp<Index, false>;
template <typename Index>
using ExpandedRowGatherOp = VariableRowGatherOp<Index, true>;

// A table gather's output: a row of the `dim` attribute's floats for each entry of the 1-D input
// `positions` (the index, or the expand through it); every input from the index on is 1-D.
tensorflow::Status TableRowsShape(shape_inference::InferenceContext* c, int positions) {
  shape_inference::ShapeHandle vector;
  for (int i = 1; i <= positions; ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 1, &vector));
  int64_t dim;
  TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
  c->set_output(0, c->Matrix(c->Dim(vector, 0), dim));
  return tensorflow::OkStatus();
}

}  // namespace

REGISTER_OP("ShardrecVariableRowGather")
    .Input("table: resource")
    .Input("index: Tindex")
    .Input("ticket: int32")
    .Output("rows: float")
    .Attr("Tindex: {int32, int64}")
    .Attr("dim: int")
    .Attr("channel: int = 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) { return TableRowsShape(c, 1); })
    .Doc("rows[i] = table[index[i]] as float32, the table a 2-D float32, float16 or bfloat16 resource variable of `dim` "
         "columns; `ticket` ([1], "
         "0: none) is the key pipeline's batch on `channel` (0 train, 1 eval), reported to the table's row store.");

REGISTER_OP("ShardrecVariableRowGatherExpanded")
    .Input("table: resource")
    .Input("index: Tindex")
    .Input("expand: int32")
    .Input("ticket: int32")
    .Output("rows: float")
    .Attr("Tindex: {int32, int64}")
    .Attr("dim: int")
    .Attr("channel: int = 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) { return TableRowsShape(c, 2); })
    .Doc("rows[i] = table[index[expand[i]]] as float32; otherwise as ShardrecVariableRowGather.");

REGISTER_OP("ShardrecRowGather")
    .Input("rows: float")
    .Input("index: Tindex")
    .Output("out: float")
    .Attr("Tindex: {int32, int64}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle rows, index;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &rows));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &index));
      c->set_output(0, c->Matrix(c->Dim(index, 0), c->Dim(rows, 1)));
      return tensorflow::OkStatus();
    })
    .Doc("out[i] = rows[index[i]].");

REGISTER_OP("ShardrecRowGatherGrad")
    .Input("grad: float")
    .Input("index: Tindex")
    .Input("num_rows: int32")
    .Output("rows_grad: float")
    .Attr("Tindex: {int32, int64}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle grad;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &grad));
      shape_inference::DimensionHandle rows = c->UnknownDim();
      if (c->RankKnown(c->input(2)) && c->Rank(c->input(2)) == 0) {
        TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(2, &rows));
      } else {
        shape_inference::ShapeHandle shape;
        TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(2, &shape));
        if (c->RankKnown(shape) && c->Rank(shape) >= 1) rows = c->Dim(shape, 0);
      }
      c->set_output(0, c->Matrix(rows, c->Dim(grad, 1)));
      return tensorflow::OkStatus();
    })
    .Doc("rows_grad[r] = sum of grad[i] over the i with index[i] == r, in order of i; num_rows: the number of "
         "rows, or a shape whose first element it is.");

SHARDREC_REGISTER_BY_INDEX("ShardrecRowGather", "Tindex", RowGatherOp);
SHARDREC_REGISTER_BY_INDEX("ShardrecRowGatherGrad", "Tindex", RowGatherGradOp);
SHARDREC_REGISTER_BY_INDEX("ShardrecVariableRowGather", "Tindex", DistinctRowGatherOp);
SHARDREC_REGISTER_BY_INDEX("ShardrecVariableRowGatherExpanded", "Tindex", ExpandedRowGatherOp);

}  // namespace shardrec
