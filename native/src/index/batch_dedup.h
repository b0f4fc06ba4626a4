// Batch deduplication: unique keys in first-seen order plus, for every position of the batch,
// the index of its key among the unique keys (so unique[restore[i]] == keys[i]).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "index/key_row_map.h"

namespace shardrec {

// Where a key goes in a table of 2^bits buckets.
struct MixedSlot {  // any int64 key: mix_key spreads keys that differ in few bits
  static size_t of(int64_t key, size_t mask, int) { return mix_key(key) & mask; }
};
struct RowSlot {  // row numbers, which a table hands out densely from 0: one multiply is enough
  static size_t of(int32_t row, size_t, int bits) {
    return static_cast<size_t>((static_cast<uint32_t>(row) * 0x9E3779B1u) >> (32 - bits));
  }
};

// An open-addressing table of `Stored` keys, reused between calls: a batch costs no allocation
// once warm. Entries are a key and an int32 index (16 bytes for int64 keys, 8 for int32 rows).
template <typename Stored, typename Slot>
class OpenDedup {
 public:
  template <typename Key>
  void run(const Key* keys, size_t n, std::vector<Stored>& unique, int32_t* restore) {
    unique.clear();
    // Sized from the last batch's unique count, not the batch length: recommendation batches
    // repeat keys heavily, and a scratch table that stays in cache is what makes this fast.
    reset(std::min(n, std::max<size_t>(last_unique_ + last_unique_ / 4, 256)));
    constexpr size_t kAhead = 8;
    for (size_t p = 0; p < n; ++p) {
      if (p + kAhead < n) __builtin_prefetch(&table_[slot(static_cast<Stored>(keys[p + kAhead]))]);
      const Stored key = static_cast<Stored>(keys[p]);
      size_t i = slot(key);
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
    Stored key;
    int32_t index;
  };

  size_t slot(Stored key) const { return Slot::of(key, mask_, bits_); }

  void reset(size_t expected) {
    size_t buckets = 64;
    bits_ = 6;
    while (buckets * 3 < expected * 4) {  // load at most 3/4
      buckets <<= 1;
      ++bits_;
    }
    if (table_.size() < buckets) table_.resize(buckets);
    mask_ = buckets - 1;
    std::fill(table_.begin(), table_.begin() + buckets, Entry{0, -1});
  }

  // Doubles the table and re-inserts the unique keys seen so far (their indices are positions).
  void grow(const std::vector<Stored>& unique) {
    reset(unique.size() * 2);
    for (size_t u = 0; u < unique.size(); ++u) {
      size_t i = slot(unique[u]);
      while (table_[i].index != -1) i = (i + 1) & mask_;
      table_[i] = Entry{unique[u], static_cast<int32_t>(u)};
    }
  }

  std::vector<Entry> table_;
  size_t mask_ = 0;
  int bits_ = 6;
  size_t last_unique_ = 0;
};

// A batch's ids (int32 or int64), any values.
using BatchDedup = OpenDedup<int64_t, MixedSlot>;
// The owner's dedup of the rows its requesters asked for (int32 row numbers): half the table and
// a cheaper hash than BatchDedup (0.51 against 0.75 ms for 61k rows of which 32k distinct).
using RowDedup = OpenDedup<int32_t, RowSlot>;

}  // namespace shardrec
