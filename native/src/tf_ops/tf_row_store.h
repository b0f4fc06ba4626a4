// A table variable whose buffer is a column of the table's native row store (row_store.h): the
// tensor the variable holds points into the store, and holds a reference on it.
#pragma once

#include "storage/row_store.h"
#include "tensorflow/core/common_runtime/dma_helper.h"
#include "tensorflow/core/framework/allocation_description.pb.h"
#include "tensorflow/core/framework/tensor.h"

namespace shardrec {

class StoreColumnBuffer : public tensorflow::TensorBuffer {
 public:
  StoreColumnBuffer(RowStore* store, int column)
      : TensorBuffer(store->column_data(column)),
        store_(store),
        bytes_(store->rows() * store->dim() * element_bytes(store->format(column))) {
    store_->ref();
  }
  ~StoreColumnBuffer() override { store_->unref(); }
  size_t size() const override { return bytes_; }
  TensorBuffer* root_buffer() override { return this; }
  void FillAllocationDescription(tensorflow::AllocationDescription* proto) const override {
    proto->set_requested_bytes(bytes_);
    proto->set_allocator_name("shardrec_row_store");
  }
  // True, so that TensorFlow's own kernels that write a variable (scatters, assigns) see the usual
  // "refcount one" and write in place, into the store, instead of copying the whole column away
  // from it. No kernel forwards this buffer as an output: the variable always holds a reference.
  bool OwnsMemory() const override { return true; }
  RowStore* store() const { return store_; }

 private:
  RowStore* const store_;
  const size_t bytes_;
};

// The TensorFlow dtype of a column of `format`.
inline tensorflow::DataType DtypeOf(RowFormat format) {
  return format == RowFormat::kFloat32   ? tensorflow::DT_FLOAT
         : format == RowFormat::kFloat16 ? tensorflow::DT_HALF
                                         : tensorflow::DT_BFLOAT16;
}

// The row format of a table variable's dtype (float32, half or bfloat16), or false.
inline bool FormatOf(tensorflow::DataType dtype, RowFormat* format) {
  switch (dtype) {
    case tensorflow::DT_FLOAT: *format = RowFormat::kFloat32; return true;
    case tensorflow::DT_HALF: *format = RowFormat::kFloat16; return true;
    case tensorflow::DT_BFLOAT16: *format = RowFormat::kBFloat16; return true;
    default: return false;
  }
}

// Whether `t` is a column of a row store: such a variable is updated in place, never copied (a copy
// would detach it from the store and, with dynamic expansion, be as large as every row it may hold).
inline bool IsStoreColumn(const tensorflow::Tensor& t) {
  return dynamic_cast<const StoreColumnBuffer*>(tensorflow::DMAHelper::buffer(&t)) != nullptr;
}

// The store whose column `t` is, or null.
inline RowStore* StoreOfColumn(const tensorflow::Tensor& t) {
  const auto* buffer = dynamic_cast<const StoreColumnBuffer*>(tensorflow::DMAHelper::buffer(&t));
  return buffer == nullptr ? nullptr : buffer->store();
}

// The store registered under `address` by rank_runtime (a reference taken), or null.
RowStore* FindStore(int64_t address);

}  // namespace shardrec
