// Batch deduplication: unique keys in first-seen order plus, for every position of the
// batch, the index of its key among the unique keys (so unique[restore[i]] == keys[i]).
#pragma once

#include <cstdint>
#include <vector>

#include "key_slot_map.h"

namespace shardrec {

class BatchDedup {
 public:
  // Reuses its scratch table between calls: a batch costs no allocation once warm.
  template <typename Key>
  void run(const Key* keys, size_t n, std::vector<int64_t>& unique, int32_t* restore) {
    size_t buckets = 16;
    while (buckets < n * 2) buckets <<= 1;
    if (index_.size() < buckets) {
      keys_.resize(buckets);
      index_.resize(buckets);
    }
    std::fill(index_.begin(), index_.begin() + buckets, -1);
    const size_t mask = buckets - 1;
    unique.clear();
    for (size_t p = 0; p < n; ++p) {
      const int64_t key = static_cast<int64_t>(keys[p]);
      size_t i = mix_key(key) & mask;
      while (index_[i] != -1 && keys_[i] != key) i = (i + 1) & mask;
      if (index_[i] == -1) {
        keys_[i] = key;
        index_[i] = static_cast<int32_t>(unique.size());
        unique.push_back(key);
      }
      restore[p] = index_[i];
    }
  }

 private:
  std::vector<int64_t> keys_;
  std::vector<int32_t> index_;
};

}  // namespace shardrec
