// Batch deduplication: unique keys in first-seen order plus, for every position of the batch,
// the index of its key among the unique keys (so unique[restore[i]] == keys[i]).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "key_row_map.h"

namespace shardrec {

class BatchDedup {
 public:
  // Reuses its scratch table between calls: a batch costs no allocation once warm.
  template <typename Key>
  void run(const Key* keys, size_t n, std::vector<int64_t>& unique, int32_t* restore) {
    unique.clear();
    // Sized from the last batch's unique count, not the batch length: recommendation batches
    // repeat keys heavily, and a scratch table that stays in cache is what makes this fast.
    reset(std::min(n, std::max<size_t>(last_unique_ + last_unique_ / 4, 256)));
    constexpr size_t kAhead = 8;
    for (size_t p = 0; p < n; ++p) {
      if (p + kAhead < n) __builtin_prefetch(&table_[mix_key(static_cast<int64_t>(keys[p + kAhead])) & mask_]);
      const int64_t key = static_cast<int64_t>(keys[p]);
      size_t i = mix_key(key) & mask_;
      while (table_[i].index != -1 && table_[i].key != key) i = (i + 1) & mask_;
      int32_t index = table_[i].index;
      if (index == -1) {
        index = static_cast<int32_t>(unique.size());
        table_[i] = Entry{key, index};
        unique.push_back(key);
        if (unique.size() * 4 > (mask_ + 1) * 3) grow(unique);
      }
      restore[p] = index;
    }
    last_unique_ = unique.size();
  }

 private:
  struct Entry {
    int64_t key;
    int32_t index;
  };

  void reset(size_t expected) {
    size_t buckets = 64;
    while (buckets * 3 < expected * 4) buckets <<= 1;  // load at most 3/4
    if (table_.size() < buckets) table_.resize(buckets);
    mask_ = buckets - 1;
    std::fill(table_.begin(), table_.begin() + buckets, Entry{0, -1});
  }

  // Doubles the table and re-inserts the unique keys seen so far (their indices are positions).
  void grow(const std::vector<int64_t>& unique) {
    reset(unique.size() * 2);
    for (size_t u = 0; u < unique.size(); ++u) {
      size_t i = mix_key(unique[u]) & mask_;
      while (table_[i].index != -1) i = (i + 1) & mask_;
      table_[i] = Entry{unique[u], static_cast<int32_t>(u)};
    }
  }

  std::vector<Entry> table_;
  size_t mask_ = 0;
  size_t last_unique_ = 0;
};

// The owner's dedup of the rows its requesters asked for (int32 row numbers): BatchDedup's contract
// with half its table (8-byte entries) and a one-multiply hash, enough for row numbers, which a
// table hands out densely from 0. At 2 ranks BatchDedup took 12% of the key pipeline's CPU here.
class RowDedup {
 public:
  void run(const int32_t* rows, size_t n, std::vector<int32_t>& unique, int32_t* restore) {
    unique.clear();
    reset(std::min(n, std::max<size_t>(last_unique_ + last_unique_ / 4, 256)));
    constexpr size_t kAhead = 8;
    for (size_t p = 0; p < n; ++p) {
      if (p + kAhead < n) __builtin_prefetch(&table_[slot(rows[p + kAhead])]);
      const int32_t row = rows[p];
      size_t i = slot(row);
      while (table_[i].index != -1 && table_[i].row != row) i = (i + 1) & mask_;
      int32_t index = table_[i].index;
      if (index == -1) {
        index = static_cast<int32_t>(unique.size());
        table_[i] = Entry{row, index};
        unique.push_back(row);
        if (unique.size() * 4 > (mask_ + 1) * 3) grow(unique);
      }
      restore[p] = index;
    }
    last_unique_ = unique.size();
  }

 private:
  struct Entry {
    int32_t row;
    int32_t index;
  };

  size_t slot(int32_t row) const {
    return static_cast<size_t>((static_cast<uint32_t>(row) * 0x9E3779B1u) >> shift_) & mask_;
  }

  void reset(size_t expected) {
    size_t buckets = 64;
    int bits = 6;
    while (buckets * 3 < expected * 4) {
      buckets <<= 1;
      ++bits;
    }
    if (table_.size() < buckets) table_.resize(buckets);
    mask_ = buckets - 1;
    shift_ = 32 - bits;
    std::fill(table_.begin(), table_.begin() + buckets, Entry{0, -1});
  }

  void grow(const std::vector<int32_t>& unique) {
    reset(unique.size() * 2);
    for (size_t u = 0; u < unique.size(); ++u) {
      size_t i = slot(unique[u]);
      while (table_[i].index != -1) i = (i + 1) & mask_;
      table_[i] = Entry{unique[u], static_cast<int32_t>(u)};
    }
  }

  std::vector<Entry> table_;
  size_t mask_ = 0;
  int shift_ = 26;
  size_t last_unique_ = 0;
};

}  // namespace shardrec
