// A table group's lookup (rank_runtime/pipeline/table_groups.py): the row gathers of N tables in one
// op, laid out for one row exchange, and the restore of the rows that come back in one op with one
// output per table. Per table a lookup ran a gather, an exchange each way and a restore, each an op
// (and the exchanges an MPI round) whatever the number of its ids: a model's step cost what its
// table count cost (issue 71).
//
// The send buffer is by requester rank, and inside each requester's block table after table:
//   [to rank 0: table 0's rows, table 1's rows, ...][to rank 1: table 0's rows, ...]...
// so one exchange with the summed splits moves every table's rows, and what comes back is by owner
// rank, then table. A table's own routing (native/src/exchange/key_exchange.h) knows its rows by
// owner only; `Placement` maps a table's position to the group's.
#include <algorithm>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tf_ops/tf_op_common.h"
#include "tf_ops/tf_table_rows.h"

namespace shardrec {
namespace {

using tensorflow::OpInputList;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::OpOutputList;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
namespace shape_inference = tensorflow::shape_inference;

// Where each table's block from (or to) each rank sits in the group's buffer: blocks[t][r] is the
// first row of table t's block for rank r, and table t's own position p (its rows by rank) is the
// group's p + shift[t][r] for the rank r whose block holds p.
struct Placement {
  std::vector<std::vector<int64_t>> own_start;  // [t][r]: where rank r's block starts among table t's rows
  std::vector<std::vector<int64_t>> blocks;     // [t][r]: where it starts in the group's buffer
  std::vector<int64_t> per_rank;                // [r]: the group's rows for (or from) rank r
  int64_t total = 0;

  // False (the kernel failed) when the splits are not [world] vectors of rows >= 0.
  bool build(OpKernelContext* ctx, const OpInputList& splits, const char* what) {
    const int64_t n = splits.size(), world = splits[0].NumElements();
    own_start.assign(n, std::vector<int64_t>(world + 1, 0));
    blocks.assign(n, std::vector<int64_t>(world, 0));
    per_rank.assign(world, 0);
    for (int64_t t = 0; t < n; ++t) {
      if (splits[t].dims() != 1 || splits[t].NumElements() != world) {
        ctx->SetStatus(InvalidArgument(what, " of table ", t, " has shape ", splits[t].shape().DebugString(),
                                       "; every table's must be [", world, "]"));
        return false;
      }
      auto s = splits[t].flat<int32_t>();
      for (int64_t r = 0; r < world; ++r) {
        if (s(r) < 0) {
          ctx->SetStatus(InvalidArgument(what, " of table ", t, " is negative for rank ", r));
          return false;
        }
        own_start[t][r + 1] = own_start[t][r] + s(r);
        per_rank[r] += s(r);
      }
    }
    std::vector<int64_t> cursor(world, 0);
    for (int64_t r = 1; r < world; ++r) cursor[r] = cursor[r - 1] + per_rank[r - 1];
    total = world > 0 ? cursor[world - 1] + per_rank[world - 1] : 0;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t r = 0; r < world; ++r) {
        blocks[t][r] = cursor[r];
        cursor[r] += splits[t].flat<int32_t>()(r);
      }
    return true;
  }

  // A group gather's outputs: the rows for the exchange, [total, dim] (returned; nullptr: the kernel
  // failed), and the group's send splits (filled).
  float* send_outputs(OpKernelContext* ctx, int64_t dim) const {
    Tensor* out = nullptr;
    Tensor* splits = nullptr;
    tensorflow::Status status = ctx->allocate_output(0, TensorShape({total, dim}), &out);
    if (status.ok()) status = ctx->allocate_output(1, TensorShape({static_cast<int64_t>(per_rank.size())}), &splits);
    if (!status.ok()) {
      ctx->SetStatus(status);
      return nullptr;
    }
    for (size_t r = 0; r < per_rank.size(); ++r) splits->flat<int32_t>()(r) = static_cast<int32_t>(per_rank[r]);
    return out->flat<float>().data();
  }

  // The group's row of each of table t's own positions.
  std::vector<int64_t> positions(int64_t t) const {
    std::vector<int64_t> out(own_start[t].back());
    for (size_t r = 0; r + 1 < own_start[t].size(); ++r)
      for (int64_t p = own_start[t][r]; p < own_start[t][r + 1]; ++p) out[p] = blocks[t][r] + p - own_start[t][r];
    return out;
  }
};

// Position i of a table's block: the table row it reads, through the expand.
struct BlockRows {
  const int32_t* index;
  const int32_t* expand;
  int64_t base;
  int32_t operator()(int64_t i) const { return index[expand[base + i]]; }
};

// rows[p] for p = positions[index[i]]: a table's rows among the group's, in its own order.
struct Through {
  const int32_t* index;
  const int64_t* positions;
  int64_t operator()(int64_t i) const { return positions[index[i]]; }
};

// tables, index, expand, send_splits, ticket: N each. Outputs the rows for the row exchange and
// its send splits. Each table is read in turn under its own lock (one table's at a time: an update
// of another is not held up), and its batch reported read to its row store.
class GroupRowGatherOp : public OpKernel {
 public:
  explicit GroupRowGatherOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    int64_t channel = 0;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("channel", &channel));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dim", &dim_));
    channel_ = static_cast<Channel>(channel);
  }

  void Compute(OpKernelContext* ctx) override {
    OpInputList index, expand, splits, tickets;
    OP_REQUIRES_OK(ctx, ctx->input_list("index", &index));
    OP_REQUIRES_OK(ctx, ctx->input_list("expand", &expand));
    OP_REQUIRES_OK(ctx, ctx->input_list("send_splits", &splits));
    OP_REQUIRES_OK(ctx, ctx->input_list("ticket", &tickets));
    Placement at;
    if (!at.build(ctx, splits, "send_splits")) return;
    const int64_t n = index.size(), world = at.per_rank.size();
    for (int64_t t = 0; t < n; ++t) {
      OP_REQUIRES(ctx, expand[t].NumElements() == at.own_start[t].back(),
                  InvalidArgument("table ", t, " of the group sends ", at.own_start[t].back(), " rows by its splits "
                                  "but has ", expand[t].NumElements(), " expand positions"));
    }
    float* dst = at.send_outputs(ctx, dim_);
    if (dst == nullptr) return;
    for (int64_t t = 0; t < n; ++t) {
      auto idx = index[t].flat<int32_t>();
      auto e = expand[t].flat<int32_t>();
      const bool read = ReadTable(ctx, t, [&](const Tensor& table, RowFormat format) {
        OP_REQUIRES(ctx, table.dim_size(1) == dim_,
                    InvalidArgument("table ", t, " of the group has ", table.dim_size(1), " columns, the group ", dim_));
        if (!IndicesInside(ctx, idx, idx.size(), table.dim_size(0), "row", "the table's")) return;
        if (!IndicesInside(ctx, e, e.size(), idx.size(), "expand", "the index's")) return;
        for (int64_t r = 0; r < world; ++r) {
          const int64_t rows = at.own_start[t][r + 1] - at.own_start[t][r];
          GatherTableRows(ctx, table, format, BlockRows{idx.data(), e.data(), at.own_start[t][r]}, rows, dim_,
                          dst + at.blocks[t][r] * dim_);
        }
        NoteGathered(table, tickets[t], channel_);
      });
      if (!read) return;
    }
  }

 private:
  int64_t dim_ = 0;
  Channel channel_ = Channel::kTrain;
};

// rows (each table's distinct rows, already read: dynamic expansion's lookups, whose rows by address
// are the tensors scripts take gradients of), expand, send_splits: N each. Outputs as
// GroupRowGatherOp's, laid out the same.
class GroupRowsGatherOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    OpInputList rows, expand, splits;
    OP_REQUIRES_OK(ctx, ctx->input_list("rows", &rows));
    OP_REQUIRES_OK(ctx, ctx->input_list("expand", &expand));
    OP_REQUIRES_OK(ctx, ctx->input_list("send_splits", &splits));
    Placement at;
    if (!at.build(ctx, splits, "send_splits")) return;
    const int64_t n = rows.size(), world = at.per_rank.size();
    const int64_t dim = rows[0].dims() == 2 ? rows[0].dim_size(1) : 0;
    float* dst = at.send_outputs(ctx, dim);
    if (dst == nullptr) return;
    for (int64_t t = 0; t < n; ++t) {
      OP_REQUIRES(ctx, rows[t].dims() == 2 && rows[t].dim_size(1) == dim,
                  InvalidArgument("rows of table ", t, " of the group has shape ", rows[t].shape().DebugString(),
                                  "; the group's rows have ", dim, " columns"));
      auto e = expand[t].flat<int32_t>();
      OP_REQUIRES(ctx, e.size() == at.own_start[t].back(),
                  InvalidArgument("table ", t, " of the group sends ", at.own_start[t].back(), " rows by its splits "
                                  "but has ", e.size(), " expand positions"));
      if (!IndicesInside(ctx, e, e.size(), rows[t].dim_size(0), "expand", "the table's distinct rows")) return;
      for (int64_t r = 0; r < world; ++r) {
        const int64_t base = at.own_start[t][r];
        GatherRows(ctx, rows[t].flat<float>().data(), [&](int64_t i) { return e(base + i); },
                   at.own_start[t][r + 1] - base, dim, dst + at.blocks[t][r] * dim);
      }
    }
  }
};

// grad (the group's rows), index, expand, send_splits: N each. Output t: table t's distinct rows'
// gradients (positions that read one row summed, in position order).
class GroupRowGatherGradOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    OpInputList index, expand, splits;
    OP_REQUIRES_OK(ctx, ctx->input_list("index", &index));
    OP_REQUIRES_OK(ctx, ctx->input_list("expand", &expand));
    OP_REQUIRES_OK(ctx, ctx->input_list("send_splits", &splits));
    Placement at;
    if (!at.build(ctx, splits, "send_splits")) return;
    OP_REQUIRES(ctx, grad.dims() == 2 && grad.dim_size(0) == at.total,
                InvalidArgument("grad has shape ", grad.shape().DebugString(), "; the group sent ", at.total, " rows"));
    const int64_t dim = grad.dim_size(1);
    const float* g = grad.flat<float>().data();
    OpOutputList outs;
    OP_REQUIRES_OK(ctx, ctx->output_list("rows_grad", &outs));
    for (int64_t t = 0; t < index.size(); ++t) {
      const int64_t rows = index[t].NumElements();
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, outs.allocate(t, TensorShape({rows, dim}), &out));
      const std::vector<int64_t> positions = at.positions(t);
      float* d = out->flat<float>().data();
      auto e = expand[t].flat<int32_t>();
      OP_REQUIRES(ctx, e.size() == static_cast<int64_t>(positions.size()),
                  InvalidArgument("table ", t, " of the group: ", e.size(), " expand positions, ", positions.size(),
                                  " by its splits"));
      if (!IndicesInside(ctx, e, e.size(), rows, "expand", "the index's")) return;
      SumRowsInto(ctx, e, e.size(), [&](int64_t i) { return g + positions[i] * dim; }, rows, dim, d);
    }
  }
};

// rows (what came back, by owner then table), recv_splits, restore: N each. Output t: table t's
// rows in its batch order.
class GroupRestoreOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    const Tensor& rows = ctx->input(0);
    OpInputList splits, restore;
    OP_REQUIRES_OK(ctx, ctx->input_list("recv_splits", &splits));
    OP_REQUIRES_OK(ctx, ctx->input_list("restore", &restore));
    Placement at;
    if (!at.build(ctx, splits, "recv_splits")) return;
    OP_REQUIRES(ctx, rows.dims() == 2 && rows.dim_size(0) == at.total,
                InvalidArgument("rows has shape ", rows.shape().DebugString(), "; the group receives ", at.total,
                                " rows"));
    const int64_t dim = rows.dim_size(1);
    OpOutputList outs;
    OP_REQUIRES_OK(ctx, ctx->output_list("out", &outs));
    for (int64_t t = 0; t < restore.size(); ++t) {
      auto idx = restore[t].flat<int32_t>();
      const std::vector<int64_t> positions = at.positions(t);
      if (!IndicesInside(ctx, idx, idx.size(), positions.size(), "restore", "the table's received")) return;
      Tensor* out = nullptr;
      OP_REQUIRES_OK(ctx, outs.allocate(t, TensorShape({idx.size(), dim}), &out));
      GatherRows(ctx, rows.flat<float>().data(), Through{idx.data(), positions.data()}, idx.size(), dim,
                 out->flat<float>().data());
    }
  }
};

// grads, recv_splits, restore: N each. Output: the gradient of the rows that came back, each the
// sum of its readers' gradients. Table by table, as SumRowsInto over each table's own rows: a
// worker scans its table's readers only (one scan of every table's readers per worker cost the
// step a pass over all of them per shard of the output: 3 ms for 26 tables of 4096 ids).
class GroupRestoreGradOp : public OpKernel {
 public:
  using OpKernel::OpKernel;

  void Compute(OpKernelContext* ctx) override {
    OpInputList grads, splits, restore;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    OP_REQUIRES_OK(ctx, ctx->input_list("recv_splits", &splits));
    OP_REQUIRES_OK(ctx, ctx->input_list("restore", &restore));
    Placement at;
    if (!at.build(ctx, splits, "recv_splits")) return;
    const int64_t dim = grads[0].dims() == 2 ? grads[0].dim_size(1) : 0;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({at.total, dim}), &out));
    float* dst = out->flat<float>().data();
    for (int64_t t = 0; t < grads.size(); ++t) {
      auto idx = restore[t].flat<int32_t>();
      const std::vector<int64_t> positions = at.positions(t);
      const int64_t n = idx.size(), n_rows = positions.size();
      OP_REQUIRES(ctx, grads[t].dims() == 2 && grads[t].dim_size(0) == n && grads[t].dim_size(1) == dim,
                  InvalidArgument("grads of table ", t, " has shape ", grads[t].shape().DebugString(), "; its restore ",
                                  n, " rows of ", dim));
      if (!IndicesInside(ctx, idx, n, n_rows, "restore", "the table's received")) return;
      const float* g = grads[t].flat<float>().data();
      const int64_t cost = dim + std::max<int64_t>(1, n / std::max<int64_t>(1, n_rows)) * (dim + 4);
      ParallelRows(ctx, n_rows, cost, [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) std::memset(dst + positions[p] * dim, 0, dim * sizeof(float));
        for (int64_t i = 0; i < n; ++i) {
          const int64_t p = idx(i);
          if (p < begin || p >= end) continue;
          float* __restrict d = dst + positions[p] * dim;
          const float* __restrict s = g + i * dim;
          for (int64_t j = 0; j < dim; ++j) d[j] += s[j];
        }
      });
    }
  }
};

tensorflow::Status PerTable(shape_inference::InferenceContext* c, const char* list, int64_t columns_of_input) {
  std::vector<shape_inference::ShapeHandle> in;
  TF_RETURN_IF_ERROR(c->input(list, &in));
  std::vector<shape_inference::ShapeHandle> out;
  for (const auto& s : in) out.push_back(c->Matrix(c->Dim(s, 0), c->Dim(c->input(columns_of_input), 1)));
  return c->set_output("out", out);
}

}  // namespace

REGISTER_OP("ShardrecGroupRowGather")
    .Input("tables: N * resource")
    .Input("index: N * int32")
    .Input("expand: N * int32")
    .Input("send_splits: N * int32")
    .Input("ticket: N * int32")
    .Output("rows: float")
    .Output("group_send_splits: int32")
    .Attr("N: int >= 1")
    .Attr("dim: int")
    .Attr("channel: int = 0")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      int64_t dim;
      TF_RETURN_IF_ERROR(c->GetAttr("dim", &dim));
      c->set_output(0, c->Matrix(c->UnknownDim(), dim));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return tensorflow::OkStatus();
    })
    .Doc("The rows N tables send to each rank, by rank then table (table t's rows for rank r: "
         "tables[t][index[t][expand[t][j]]] for j in its send_splits[t][r] block), "
         "and the group's send splits. Each ticket as ShardrecVariableRowGather's.");

REGISTER_OP("ShardrecGroupRowsGather")
    .Input("rows: N * float")
    .Input("expand: N * int32")
    .Input("send_splits: N * int32")
    .Output("group_rows: float")
    .Output("group_send_splits: int32")
    .Attr("N: int >= 1")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Matrix(c->UnknownDim(), c->Dim(c->input(0), 1)));
      c->set_output(1, c->Vector(c->UnknownDim()));
      return tensorflow::OkStatus();
    })
    .Doc("As ShardrecGroupRowGather from rows already read: table t's rows for rank r are "
         "rows[t][expand[t][j]] for j in its send_splits[t][r] block.");

REGISTER_OP("ShardrecGroupRowGatherGrad")
    .Input("grad: float")
    .Input("index: N * int32")
    .Input("expand: N * int32")
    .Input("send_splits: N * int32")
    .Output("rows_grad: N * float")
    .Attr("N: int >= 1")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      std::vector<shape_inference::ShapeHandle> index, out;
      TF_RETURN_IF_ERROR(c->input("index", &index));
      for (const auto& s : index) out.push_back(c->Matrix(c->Dim(s, 0), c->Dim(c->input(0), 1)));
      return c->set_output("rows_grad", out);
    })
    .Doc("rows_grad[t][k] = sum of grad at the group positions of table t that read its row k.");

REGISTER_OP("ShardrecGroupRestore")
    .Input("rows: float")
    .Input("recv_splits: N * int32")
    .Input("restore: N * int32")
    .Output("out: N * float")
    .Attr("N: int >= 1")
    .SetShapeFn([](shape_inference::InferenceContext* c) { return PerTable(c, "restore", 0); })
    .Doc("out[t][i] = the row of rows (by owner rank, then table) that table t's restore[t][i] names among its own.");

REGISTER_OP("ShardrecGroupRestoreGrad")
    .Input("grads: N * float")
    .Input("recv_splits: N * int32")
    .Input("restore: N * int32")
    .Output("rows_grad: float")
    .Attr("N: int >= 1")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      c->set_output(0, c->Matrix(c->UnknownDim(), c->Dim(c->input(0), 1)));
      return tensorflow::OkStatus();
    })
    .Doc("The gradient of ShardrecGroupRestore's rows: each row's readers' gradients summed.");

REGISTER_KERNEL_BUILDER(Name("ShardrecGroupRowGather").Device(tensorflow::DEVICE_CPU), GroupRowGatherOp);
REGISTER_KERNEL_BUILDER(Name("ShardrecGroupRowsGather").Device(tensorflow::DEVICE_CPU), GroupRowsGatherOp);
REGISTER_KERNEL_BUILDER(Name("ShardrecGroupRowGatherGrad").Device(tensorflow::DEVICE_CPU), GroupRowGatherGradOp);
REGISTER_KERNEL_BUILDER(Name("ShardrecGroupRestore").Device(tensorflow::DEVICE_CPU), GroupRestoreOp);
REGISTER_KERNEL_BUILDER(Name("ShardrecGroupRestoreGrad").Device(tensorflow::DEVICE_CPU), GroupRestoreGradOp);

}  // namespace shardrec
