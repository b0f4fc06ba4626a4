// Fused sparse-apply kernels for shardrec's sparse optimizers (TensorFlow custom ops, loaded by
// rank_runtime/embedding/native_ops.py). Each updates a table's rows and their slot rows in one pass over the
// distinct rows of a step, in parallel over rows on TensorFlow's intra-op pool.
//
// Why in-place parallel writes are safe: the rows handed in are distinct (the key pipeline dedups
// them on the owner, and a gradient summed over several lookups is deduped by the optimizer before
// it comes here), so no two workers touch the same row. The variables' mutexes are held for the
// whole update, exactly as TensorFlow's own ResourceSparseApply* kernels hold them, so a gather of
// the next batch (which takes the same mutex, shared) never sees a half-written row.
//
// 16-bit tables (row_format.h): each row and its slot rows are widened to float32, updated with the
// same float32 arithmetic, and narrowed back, stochastically unless the table asks for nearest
// rounding; the random numbers come from the training step the op is given (`step`, the global step
// before this update; -1: none, then the table's own count of updates), so a run is reproducible.
//
// Copy on write, as TensorFlow's kernels do: when a variable's buffer is shared (a read of it is
// still alive), it is copied before the update so the earlier read keeps its values. Not for a
// table bound to its native row store: its rows are updated in place, always (tf_row_store.h).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tf_ops/tf_op_common.h"
#include "tf_ops/tf_row_store.h"

namespace shardrec {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::Var;
using tensorflow::errors::InvalidArgument;

Status NoOutputs(tensorflow::shape_inference::InferenceContext*) { return tensorflow::OkStatus(); }

// The variables of one update, locked in a fixed order (by address) so two updates of the same
// tables never deadlock, and made exclusive (copied if a read still shares their buffer).
class LockedVariables {
 public:
  LockedVariables(OpKernelContext* ctx, const std::vector<int>& inputs) {
    for (int i : inputs) {
      Var* var = nullptr;
      Status s = tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, i), &var);
      if (!s.ok()) {
        ctx->SetStatus(s);
        return;
      }
      vars_.push_back(var);
    }
    std::vector<Var*> order(vars_);
    std::sort(order.begin(), order.end());
    order.erase(std::unique(order.begin(), order.end()), order.end());
    for (Var* var : order) {
      var->mu()->lock();
      locked_.push_back(var);
    }
    for (Var* var : vars_) {
      Tensor* t = var->tensor();
      if (!t->IsInitialized()) {
        ctx->SetStatus(InvalidArgument("a variable of this sparse update is not initialised; run the "
                                       "variables' initializer (or restore a checkpoint) first"));
        return;
      }
      if (!t->RefCountIsOne() && !IsStoreColumn(*t)) {
        Tensor copy;
        Status a = ctx->allocate_temp(t->dtype(), t->shape(), &copy);
        if (!a.ok()) {
          ctx->SetStatus(a);
          return;
        }
        std::memcpy(copy.data(), t->data(), t->TotalBytes());
        *t = copy;
      }
    }
  }
  ~LockedVariables() {
    for (Var* var : locked_) var->mu()->unlock();
    for (Var* var : vars_) var->Unref();
  }
  const Tensor& tensor(int i) { return *vars_[i]->tensor(); }

 private:
  std::vector<Var*> vars_;
  std::vector<Var*> locked_;
};

// Checks shapes and indices, then runs `update(rows, grad row, dim)` over the rows in parallel;
// rows[k] is the row of variable k as float32 (a 16-bit row widened into scratch, narrowed after).
template <typename Index, typename Update>
void ForEachRow(OpKernelContext* ctx, LockedVariables& vars, int n_vars, const Tensor& indices, const Tensor& grad,
                const Tensor& step, int cost_per_element, Update update) {
  constexpr int kMaxVars = 3;
  const Tensor& first = vars.tensor(0);
  OP_REQUIRES(ctx, first.dims() == 2,
              InvalidArgument("the table variable must be 2-D, got ", first.shape().DebugString()));
  RowFormat formats[kMaxVars];
  char* bases[kMaxVars];
  bool all_float32 = true;
  for (int i = 0; i < n_vars; ++i) {
    const Tensor& t = vars.tensor(i);
    OP_REQUIRES(ctx, t.shape() == first.shape(),
                InvalidArgument("slot ", i, " has shape ", t.shape().DebugString(), ", the table ",
                                first.shape().DebugString()));
    OP_REQUIRES(ctx, FormatOf(t.dtype(), &formats[i]),
                InvalidArgument("variable ", i, " of the update is ", tensorflow::DataTypeString(t.dtype()),
                                "; allowed: float32, float16, bfloat16"));
    bases[i] = static_cast<char*>(const_cast<void*>(t.data()));
    all_float32 = all_float32 && formats[i] == RowFormat::kFloat32;
  }
  const int64_t rows = first.dim_size(0), dim = first.dim_size(1);
  OP_REQUIRES(ctx, indices.dims() == 1, InvalidArgument("indices must be 1-D"));
  OP_REQUIRES(ctx, step.NumElements() == 1, InvalidArgument("step must be a scalar"));
  const int64_t n = indices.dim_size(0);
  OP_REQUIRES(ctx, grad.dims() == 2 && grad.dim_size(0) == n && grad.dim_size(1) == dim,
              InvalidArgument("grad has shape ", grad.shape().DebugString(), "; expected [", n, ", ", dim, "]"));
  auto idx = indices.flat<Index>();
  if (!IndicesInside(ctx, idx, n, rows, "row index", "the table's")) return;
  const float* g = grad.flat<float>().data();
  // The last row is the sentinel, what ids without a row read (not admitted yet, unknown at
  // evaluation, padding): it never changes, whatever gradient reaches it.
  const int64_t sentinel = rows - 1;
  // Each updated row is flagged for the next incremental checkpoint (a byte store per row).
  RowStore* store = StoreOfColumn(first);
  uint8_t* changed = store != nullptr ? store->changed_if_tracked() : nullptr;
  int64_t element[kMaxVars];
  for (int k = 0; k < n_vars; ++k) element[k] = element_bytes(formats[k]);
  const bool stochastic = store == nullptr || store->stochastic_rounding();
  const int64_t given = step.flat<int64_t>()(0);
  const uint64_t seed = static_cast<uint64_t>(given >= 0 || store == nullptr ? given : store->next_update());
  auto work = [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(all_float32 ? 0 : n_vars * dim);
    float* row[kMaxVars];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = static_cast<int64_t>(idx(i));
      if (r == sentinel) continue;
      if (changed != nullptr) changed[r] = 1;
      // The rows are scattered over the table: ask for a later row's lines now, so that the
      // arithmetic of this row overlaps the memory latency of that one (measured: 14 -> 8 ms for
      // 60k rows of dim 16 under lazy Adam, one thread).
      if (i + kPrefetchAhead < end) {
        const int64_t row_ahead = static_cast<int64_t>(idx(i + kPrefetchAhead));
        for (int k = 0; k < n_vars; ++k) __builtin_prefetch(bases[k] + row_ahead * dim * element[k], 1);
        if (changed != nullptr) __builtin_prefetch(changed + row_ahead, 1);
      }
      if (all_float32) {
        for (int k = 0; k < n_vars; ++k) row[k] = reinterpret_cast<float*>(bases[k]) + r * dim;
        update(row, g + i * dim, dim);
        continue;
      }
      for (int k = 0; k < n_vars; ++k) {
        row[k] = scratch.data() + k * dim;
        widen(bases[k] + r * dim * element[k], formats[k], dim, row[k]);
      }
      update(row, g + i * dim, dim);
      for (int k = 0; k < n_vars; ++k) {
        void* dst = bases[k] + r * dim * element[k];
        if (stochastic)
          narrow_stochastic(row[k], dim, formats[k], dst, row_format::mix(seed * kMaxVars + k));
        else
          narrow_nearest(row[k], dim, formats[k], dst);
      }
    }
  };
  ParallelRows(ctx, n, dim * cost_per_element, work);
}

template <typename Index>
class SgdOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    LockedVariables vars(ctx, {0});
    if (!ctx->status().ok()) return;
    const float lr = ctx->input(3).scalar<float>()();
    ForEachRow<Index>(ctx, vars, 1, ctx->input(1), ctx->input(2), ctx->input(4), 2,
                      [=](float* const* row, const float* g, int64_t dim) {
      float* w = row[0];
      for (int64_t j = 0; j < dim; ++j) w[j] -= lr * g[j];
    });
  }
};

template <typename Index>
class AdagradOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    LockedVariables vars(ctx, {0, 1});
    if (!ctx->status().ok()) return;
    const float lr = ctx->input(4).scalar<float>()();
    ForEachRow<Index>(ctx, vars, 2, ctx->input(2), ctx->input(3), ctx->input(5), 8,
                      [=](float* const* row, const float* g, int64_t dim) {
      float* w = row[0];
      float* a = row[1];
      for (int64_t j = 0; j < dim; ++j) {
        a[j] += g[j] * g[j];
        w[j] -= lr * g[j] / std::sqrt(a[j]);
      }
    });
  }
};

template <typename Index>
class LazyAdamOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    LockedVariables vars(ctx, {0, 1, 2});
    if (!ctx->status().ok()) return;
    const float lr = ctx->input(5).scalar<float>()();  // with Adam's bias correction folded in
    const float b1 = ctx->input(6).scalar<float>()();
    const float b2 = ctx->input(7).scalar<float>()();
    const float eps = ctx->input(8).scalar<float>()();
    ForEachRow<Index>(ctx, vars, 3, ctx->input(3), ctx->input(4), ctx->input(9), 12,
                      [=](float* const* row, const float* g, int64_t dim) {
      float* w = row[0];
      float* mr = row[1];
      float* vr = row[2];
      for (int64_t j = 0; j < dim; ++j) {
        mr[j] = b1 * mr[j] + (1 - b1) * g[j];
        vr[j] = b2 * vr[j] + (1 - b2) * (g[j] * g[j]);
        w[j] -= lr * mr[j] / (std::sqrt(vr[j]) + eps);
      }
    });
  }
};

// FTRL-Proximal as TensorFlow's ResourceSparseApplyFtrl computes it (multiply_linear_by_lr false).
template <typename Index>
class FtrlOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    LockedVariables vars(ctx, {0, 1, 2});
    if (!ctx->status().ok()) return;
    const float lr = ctx->input(5).scalar<float>()();
    const float l1 = ctx->input(6).scalar<float>()();
    const float l2 = ctx->input(7).scalar<float>()();
    const float power = ctx->input(8).scalar<float>()();
    OP_REQUIRES(ctx, lr > 0, InvalidArgument("FTRL learning rate must be > 0, got ", lr));
    const bool half = power == -0.5f;
    ForEachRow<Index>(ctx, vars, 3, ctx->input(3), ctx->input(4), ctx->input(9), 30,
                      [=](float* const* row, const float* g, int64_t dim) {
      float* w = row[0];
      float* a = row[1];
      float* l = row[2];
      for (int64_t j = 0; j < dim; ++j) {
        const float new_a = a[j] + g[j] * g[j];
        const float pow_new = half ? std::sqrt(new_a) : std::pow(new_a, -power);
        const float pow_old = half ? std::sqrt(a[j]) : std::pow(a[j], -power);
        l[j] += g[j] - (pow_new - pow_old) / lr * w[j];
        const float quadratic = pow_new / lr + 2 * l2;
        w[j] = std::fabs(l[j]) > l1 ? ((l[j] > 0 ? l1 : -l1) - l[j]) / quadratic : 0.0f;
        a[j] = new_a;
      }
    });
  }
};

}  // namespace

REGISTER_OP("ShardrecSparseApplySgd")
    .Input("var: resource")
    .Input("indices: Tindices")
    .Input("grad: float")
    .Input("lr: float")
    .Input("step: int64")
    .Attr("Tindices: {int32, int64}")
    .SetShapeFn(NoOutputs)
    .Doc("var[indices[i]] -= lr * grad[i]; indices distinct; `step` seeds a 16-bit table's rounding.");

REGISTER_OP("ShardrecSparseApplyAdagrad")
    .Input("var: resource")
    .Input("accum: resource")
    .Input("indices: Tindices")
    .Input("grad: float")
    .Input("lr: float")
    .Input("step: int64")
    .Attr("Tindices: {int32, int64}")
    .SetShapeFn(NoOutputs)
    .Doc("Adagrad on the rows indices (distinct): accum += g^2; var -= lr * g / sqrt(accum).");

REGISTER_OP("ShardrecSparseApplyLazyAdam")
    .Input("var: resource")
    .Input("m: resource")
    .Input("v: resource")
    .Input("indices: Tindices")
    .Input("grad: float")
    .Input("lr: float")
    .Input("beta1: float")
    .Input("beta2: float")
    .Input("epsilon: float")
    .Input("step: int64")
    .Attr("Tindices: {int32, int64}")
    .SetShapeFn(NoOutputs)
    .Doc("Lazy Adam on the rows indices (distinct); lr carries the bias correction.");

REGISTER_OP("ShardrecSparseApplyFtrl")
    .Input("var: resource")
    .Input("accum: resource")
    .Input("linear: resource")
    .Input("indices: Tindices")
    .Input("grad: float")
    .Input("lr: float")
    .Input("l1: float")
    .Input("l2: float")
    .Input("lr_power: float")
    .Input("step: int64")
    .Attr("Tindices: {int32, int64}")
    .SetShapeFn(NoOutputs)
    .Doc("FTRL-Proximal on the rows indices (distinct), as ResourceSparseApplyFtrl.");

SHARDREC_REGISTER_BY_INDEX("ShardrecSparseApplySgd", "Tindices", SgdOp);
SHARDREC_REGISTER_BY_INDEX("ShardrecSparseApplyAdagrad", "Tindices", AdagradOp);
SHARDREC_REGISTER_BY_INDEX("ShardrecSparseApplyLazyAdam", "Tindices", LazyAdamOp);
SHARDREC_REGISTER_BY_INDEX("ShardrecSparseApplyFtrl", "Tindices", FtrlOp);

}  // namespace shardrec
