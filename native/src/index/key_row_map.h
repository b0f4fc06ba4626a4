// Open-addressing map from int64 key to int32 row (or any int32 place): two flat arrays, linear probing,
// backward-shift deletion (no tombstones, so probe chains never degrade after eviction).
// Load at most 3/4: 16 bytes per key at best, 21 at worst, for short probe runs with mix_key.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace shardrec {

// splitmix64's finaliser: feature ids are often sequential or share high bits
// (field << 32 | value), and linear probing needs them spread over the whole array.
inline uint64_t mix_key(int64_t key) {
  uint64_t z = static_cast<uint64_t>(key);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

class KeyRowMap {
 public:
  static constexpr int32_t kEmpty = -1;

  explicit KeyRowMap(size_t expected = 16) { rehash(bucket_count_for(expected)); }

  size_t size() const { return size_; }
  size_t bucket_count() const { return keys_.size(); }
  size_t memory_bytes() const {
    return keys_.capacity() * sizeof(int64_t) + rows_.capacity() * sizeof(int32_t);
  }

  // Returns the row of `key`, or kEmpty.
  int32_t find(int64_t key) const {
    for (size_t i = mix_key(key) & mask_;; i = (i + 1) & mask_) {
      if (rows_[i] == kEmpty) return kEmpty;
      if (keys_[i] == key) return rows_[i];
    }
  }

  // Returns the bucket holding `key`, or the empty bucket where it would go.
  size_t probe(int64_t key) const {
    size_t i = mix_key(key) & mask_;
    while (rows_[i] != kEmpty && keys_[i] != key) i = (i + 1) & mask_;
    return i;
  }
  bool occupied(size_t bucket) const { return rows_[bucket] != kEmpty; }
  // Brings `key`'s home bucket into cache ahead of a probe.
  void prefetch(int64_t key) const {
    const size_t i = mix_key(key) & mask_;
    __builtin_prefetch(&keys_[i]);
    __builtin_prefetch(&rows_[i]);
  }
  int32_t row_at(size_t bucket) const { return rows_[bucket]; }
  // Points an occupied bucket's key at another row.
  void set_row_at(size_t bucket, int32_t row) { rows_[bucket] = row; }
  int64_t key_at(size_t bucket) const { return keys_[bucket]; }

  // Room for `n` keys without growing (never shrinks).
  void reserve(size_t n) {
    const size_t buckets = bucket_count_for(n);
    if (buckets > keys_.size()) rehash(buckets);
  }

  // Stores key→row in the empty bucket found by probe(); may grow, which moves buckets.
  void insert_at(size_t bucket, int64_t key, int32_t row) {
    keys_[bucket] = key;
    rows_[bucket] = row;
    if (++size_ * 4 > keys_.size() * 3) rehash(keys_.size() * 2);
  }

  // Removes `key`; returns its row or kEmpty.
  int32_t erase(int64_t key) {
    size_t i = probe(key);
    if (rows_[i] == kEmpty) return kEmpty;
    const int32_t row = rows_[i];
    // Backward shift: pull later entries of the same probe run into the hole.
    size_t hole = i;
    for (size_t j = (i + 1) & mask_; rows_[j] != kEmpty; j = (j + 1) & mask_) {
      const size_t home = mix_key(keys_[j]) & mask_;
      // Move j into the hole unless its home lies cyclically in (hole, j].
      const bool home_after_hole = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!home_after_hole) {
        keys_[hole] = keys_[j];
        rows_[hole] = rows_[j];
        hole = j;
      }
    }
    rows_[hole] = kEmpty;
    --size_;
    return row;
  }

  // Forgets every key, keeping the buckets.
  void clear() {
    std::fill(rows_.begin(), rows_.end(), kEmpty);
    size_ = 0;
  }

  template <typename F>
  void for_each(F&& f) const {
    for (size_t i = 0; i < rows_.size(); ++i)
      if (rows_[i] != kEmpty) f(keys_[i], rows_[i]);
  }

 private:
  static size_t bucket_count_for(size_t n) {
    size_t b = 16;
    while (b * 3 < n * 4) b <<= 1;
    return b;
  }

  void rehash(size_t buckets) {
    std::vector<int64_t> old_keys(buckets);
    std::vector<int32_t> old_rows(buckets, kEmpty);
    old_keys.swap(keys_);
    old_rows.swap(rows_);
    mask_ = buckets - 1;
    for (size_t i = 0; i < old_rows.size(); ++i) {
      if (old_rows[i] == kEmpty) continue;
      const size_t b = probe(old_keys[i]);
      keys_[b] = old_keys[i];
      rows_[b] = old_rows[i];
    }
  }

  std::vector<int64_t> keys_;
  std::vector<int32_t> rows_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace shardrec
