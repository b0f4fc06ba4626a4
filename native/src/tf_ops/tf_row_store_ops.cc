// Binding table variables to their native row store (row_store.h).
//
// rank_runtime creates a table's store through the pybind11 core and registers its address here
// (shardrec_store_register, through ctypes); the bind op, the variable's initializer, finds it by
// that address and makes a column of the store the variable's tensor. A graph whose address is not
// registered in this process (a graph imported from elsewhere) gets an error, never a wild pointer.
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_set>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tf_ops/tf_row_store.h"

namespace shardrec {
namespace {

std::mutex registry_mu;
std::unordered_set<RowStore*>& registry() {
  static auto* stores = new std::unordered_set<RowStore*>();
  return *stores;
}

}  // namespace

RowStore* FindStore(int64_t address) {
  std::lock_guard<std::mutex> g(registry_mu);
  auto* store = reinterpret_cast<RowStore*>(address);
  if (registry().count(store) == 0) return nullptr;
  store->ref();
  return store;
}

}  // namespace shardrec

extern "C" {
// Keeps a reference on the store until it is unregistered.
__attribute__((visibility("default"))) int shardrec_store_register(void* address) {
  std::lock_guard<std::mutex> g(shardrec::registry_mu);
  auto* store = static_cast<shardrec::RowStore*>(address);
  if (shardrec::registry().insert(store).second) store->ref();
  return 0;
}
__attribute__((visibility("default"))) int shardrec_store_unregister(void* address) {
  std::lock_guard<std::mutex> g(shardrec::registry_mu);
  auto* store = static_cast<shardrec::RowStore*>(address);
  if (shardrec::registry().erase(store)) store->unref();
  return 0;
}
}

namespace shardrec {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::Var;
using tensorflow::errors::FailedPrecondition;
using tensorflow::errors::InvalidArgument;

// The variable's initializer: makes `column` of the store its tensor. Column 0 with `initial` rows
// (a table of fixed size) takes TensorFlow's initial values, adopting their buffer; otherwise the
// rows in use are drawn again (values) or refilled (slots), as an initializer that runs again would.
class StoreBindOp : public OpKernel {
 public:
  explicit StoreBindOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("store", &address_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("column", &column_));
  }

  void Compute(OpKernelContext* ctx) override {
    RowStore* store = FindStore(address_);
    OP_REQUIRES(ctx, store != nullptr,
                FailedPrecondition("this table's row store is not in this process (a graph imported from another "
                                   "process?): build the graph with create_table in this process"));
    struct Release {
      RowStore* s;
      ~Release() { s->unref(); }
    } release{store};
    OP_REQUIRES(ctx, column_ >= 0 && column_ < store->n_columns(),
                InvalidArgument("the row store of table '", store->name(), "' has no column ", column_));
    const Tensor& initial = ctx->input(1);
    const int64_t rows = store->rows(), dim = store->dim();
    if (column_ == 0 && initial.NumElements() > 0) {
      OP_REQUIRES(ctx, initial.dims() == 2 && initial.dim_size(0) == rows && initial.dim_size(1) == dim,
                  InvalidArgument("initial values of shape ", initial.shape().DebugString(), " for a table of ", rows,
                                  " rows of ", dim));
      if (!TakeInitialValues(ctx, store, initial)) return;
    } else {
      store->reinitialise(column_);
    }
    const tensorflow::DataType dtype = DtypeOf(store->format(column_));
    Var* var = nullptr;
    OP_REQUIRES_OK(ctx, tensorflow::LookupOrCreateResource<Var>(ctx, tensorflow::HandleFromInput(ctx, 0), &var,
                                                                [dtype](Var** v) {
                                                                  *v = new Var(dtype);
                                                                  return tensorflow::OkStatus();
                                                                }));
    tensorflow::core::ScopedUnref unref_var(var);
    auto* buffer = new StoreColumnBuffer(store, column_);
    Tensor bound(dtype, TensorShape({rows, dim}), buffer);
    buffer->Unref();
    tensorflow::mutex_lock lock(*var->mu());
    *var->tensor() = bound;
    var->is_initialized = true;
  }


 private:
  // A fixed table's values from TensorFlow's initial values: a float32 column adopts their buffer;
  // a 16-bit one takes each value to the nearest 16-bit number. False with the kernel's status set.
  static bool TakeInitialValues(OpKernelContext* ctx, RowStore* store, const Tensor& initial) {
    try {
      if (store->format(0) != RowFormat::kFloat32) {
        store->narrow_values(initial.flat<float>().data());
        return true;
      }
      // The store keeps a reference on TensorFlow's buffer for as long as it uses it. A buffer that
      // something else still holds (a constant folded by TensorFlow) is copied first: the table's
      // rows are written in place.
      auto owner = std::make_unique<Tensor>(initial);
      if (!initial.RefCountIsOne()) {
        Tensor copy;
        tensorflow::Status a = ctx->allocate_temp(tensorflow::DT_FLOAT, initial.shape(), &copy);
        if (!a.ok()) {
          ctx->SetStatus(a);
          return false;
        }
        std::memcpy(copy.flat<float>().data(), initial.flat<float>().data(), initial.TotalBytes());
        *owner = copy;
      }
      float* values = owner->flat<float>().data();
      store->adopt_values(values, [](void* t) { delete static_cast<Tensor*>(t); }, owner.get());
      owner.release();  // the store's now
      return true;
    } catch (const std::exception& e) {
      ctx->SetStatus(tensorflow::errors::ResourceExhausted(e.what()));
      return false;
    }
  }

  int64_t address_ = 0;
  int64_t column_ = 0;
};

}  // namespace

REGISTER_OP("ShardrecStoreBind")
    .Input("var: resource")
    .Input("initial: float")
    .Attr("store: int")
    .Attr("column: int")
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext*) { return tensorflow::OkStatus(); })
    .Doc("Makes `column` of the registered row store at address `store` the variable's tensor.");

REGISTER_KERNEL_BUILDER(Name("ShardrecStoreBind").Device(tensorflow::DEVICE_CPU), StoreBindOp);

}  // namespace shardrec
