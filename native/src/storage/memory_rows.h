// The memory rows of a table shard: which rows of its row store hold a key and which are free.
// Rows are handed out from the freed ones first, then from the never-used ones in order (putting
// the next chunk of the store in use, dynamic expansion), so that the rows in use stay dense.
// Not thread-safe: the owning EmbeddingIndex holds its lock.
#pragma once

#include <cstdint>
#include <vector>

#include "storage/row_store.h"

namespace shardrec {

class MemoryRows {
 public:
  MemoryRows(RowStore* store, int32_t capacity) : store_(store), capacity_(capacity) {}

  int32_t capacity() const { return capacity_; }
  // Rows ever handed out: every row in use is below it.
  int32_t high() const { return next_; }
  size_t available() const { return free_.size() + static_cast<size_t>(capacity_ - next_); }
  // Whether take() would hand out a freed row (whose old values must be reset).
  bool reusing() const { return !free_.empty(); }

  // A free row, or -1 when every row holds a key.
  int32_t take() {
    if (!free_.empty()) {
      const int32_t s = free_.back();
      free_.pop_back();
      return s;
    }
    if (next_ >= capacity_) return -1;
    store_->ensure_rows(static_cast<int64_t>(next_) + 1);
    return next_++;
  }
  void release(int32_t row) { free_.push_back(row); }
  template <typename Rows>
  void release_all(const Rows& rows) {
    free_.insert(free_.end(), rows.begin(), rows.end());
  }

  void clear() {
    free_.clear();
    free_.shrink_to_fit();
    next_ = 0;
  }
  size_t memory_bytes() const { return free_.capacity() * sizeof(int32_t); }

 private:
  RowStore* const store_;
  const int32_t capacity_;
  std::vector<int32_t> free_;
  int32_t next_ = 0;
};

}  // namespace shardrec
