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
  size_t bucket_count() const { return buckets_.size(); }
  size_t memory_bytes() const { return buckets_.capacity() * sizeof(Bucket); }

  // Returns the row of `key`, or kEmpty.
  int32_t find(int64_t key) const {
    const size_t i = probe(key);
    return buckets_[i].row;
  }

  // Returns the bucket holding `key`, or the empty bucket where it would go.
  size_t probe(int64_t key) const {
    size_t i = mix_key(key) & mask_;
    while (buckets_[i].row != kEmpty && buckets_[i].key != key) i = (i + 1) & mask_;
    return i;
  }
  bool occupied(size_t bucket) const { return buckets_[bucket].row != kEmpty; }
  // Brings `key`'s home bucket into cache ahead of a probe.
  void prefetch(int64_t key) const { __builtin_prefetch(&buckets_[mix_key(key) & mask_]); }
  int32_t row_at(size_t bucket) const { return buckets_[bucket].row; }
  // Points an occupied bucket's key at another row.
  void set_row_at(size_t bucket, int32_t row) { buckets_[bucket].row = row; }
  int64_t key_at(size_t bucket) const { return buckets_[bucket].key; }

  // Room for `n` keys without growing (never shrinks).
  void reserve(size_t n) {
    const size_t buckets = bucket_count_for(n);
    if (buckets > buckets_.size()) rehash(buckets);
  }

  // Stores key→row in the empty bucket found by probe(); may grow, which moves buckets.
  void insert_at(size_t bucket, int64_t key, int32_t row) {
    buckets_[bucket] = Bucket{key, row};
    if (++size_ * 4 > buckets_.size() * 3) rehash(buckets_.size() * 2);
  }

  // Removes `key`; returns its row or kEmpty.
  int32_t erase(int64_t key) {
    size_t i = probe(key);
    if (buckets_[i].row == kEmpty) return kEmpty;
    const int32_t row = buckets_[i].row;
    // Backward shift: pull later entries of the same probe run into the hole.
    size_t hole = i;
    for (size_t j = (i + 1) & mask_; buckets_[j].row != kEmpty; j = (j + 1) & mask_) {
      const size_t home = mix_key(buckets_[j].key) & mask_;
      // Move j into the hole unless its home lies cyclically in (hole, j].
      const bool home_after_hole = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!home_after_hole) {
        buckets_[hole] = buckets_[j];
        hole = j;
      }
    }
    buckets_[hole].row = kEmpty;
    --size_;
    return row;
  }

  // Forgets every key, keeping the buckets.
  void clear() {
    for (auto& b : buckets_) b.row = kEmpty;
    size_ = 0;
  }

  template <typename F>
  void for_each(F&& f) const {
    for (const auto& b : buckets_)
      if (b.row != kEmpty) f(b.key, b.row);
  }

 private:
  // Key and row side by side, 12 bytes with no padding: a lookup of a key not in cache costs
  // one cache line (two for one bucket in eight), where separate arrays of keys and rows cost two
  // (bench/limit.py, SGD dim 16 on one core: 68.2, 63.6, 56.3 -> 59.6, 55.4, 57.3 ns of CPU per id).
#pragma pack(push, 4)
  struct Bucket {
    int64_t key;
    int32_t row;
  };
#pragma pack(pop)
  static_assert(sizeof(Bucket) == 12, "a bucket is a key and a row, unpadded");

  static size_t bucket_count_for(size_t n) {
    size_t b = 16;
    while (b * 3 < n * 4) b <<= 1;
    return b;
  }

  void rehash(size_t buckets) {
    std::vector<Bucket> old(buckets, Bucket{0, kEmpty});
    old.swap(buckets_);
    mask_ = buckets - 1;
    for (const auto& b : old)
      if (b.row != kEmpty) buckets_[probe(b.key)] = b;
  }

  std::vector<Bucket> buckets_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace shardrec
