// The keys of a table with admission that have no row yet: each one's count of occurrences and
// newest timestamp, until its count reaches the access threshold (it gets a row) or eviction
// forgets it. A key map of its own, key -> place in the count and timestamp arrays; freed places
// are reused. Not thread-safe: the EmbeddingIndex that owns it holds its lock around every call.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "index/index_state.h"
#include "index/key_row_map.h"

namespace shardrec {

inline uint32_t saturated(uint64_t c) { return static_cast<uint32_t>(std::min<uint64_t>(c, UINT32_MAX)); }

class CountingKeys {
 public:
  static constexpr int32_t kNone = KeyRowMap::kEmpty;

  // Where `key` counts (kNone: not counting), and the bucket that add() takes for it.
  struct Found {
    size_t bucket;
    int32_t at;
  };
  Found find(int64_t key) const {
    const size_t b = map_.probe(key);
    return Found{b, map_.occupied(b) ? map_.row_at(b) : kNone};
  }
  int32_t at(int64_t key) const { return map_.find(key); }
  void prefetch(int64_t key) const { map_.prefetch(key); }

  uint32_t& count(int32_t p) { return count_[p]; }
  int64_t& last_seen(int32_t p) { return ts_[p]; }
  uint32_t count(int32_t p) const { return count_[p]; }
  int64_t last_seen(int32_t p) const { return ts_[p]; }

  // `key` starts counting at `found.bucket` (find() said it was not counting).
  void add(size_t bucket, int64_t key, uint64_t count, int64_t ts) {
    int32_t p;
    if (!free_.empty()) {
      p = free_.back();
      free_.pop_back();
      count_[p] = saturated(count);
      ts_[p] = ts;
    } else {
      p = static_cast<int32_t>(count_.size());
      count_.push_back(saturated(count));
      ts_.push_back(ts);
    }
    map_.insert_at(bucket, key, p);
  }
  // A checkpoint's counting key: added, or its count and timestamp replaced.
  void set(int64_t key, uint32_t count, int64_t ts) {
    const Found f = find(key);
    if (f.at == kNone) {
      add(f.bucket, key, count, ts);
      return;
    }
    count_[f.at] = count;
    ts_[f.at] = ts;
  }
  void forget(int64_t key, int32_t p) {
    map_.erase(key);
    free_.push_back(p);
  }

  template <typename F>
  void for_each(F&& f) const {
    map_.for_each(f);
  }
  size_t size() const { return map_.size(); }
  size_t memory_bytes() const {
    return map_.memory_bytes() + count_.capacity() * sizeof(uint32_t) + ts_.capacity() * sizeof(int64_t) +
           free_.capacity() * sizeof(int32_t);
  }
  void clear() {
    map_.clear();
    count_.clear();
    ts_.clear();
    free_.clear();
  }

  PendingKeys export_all() const {
    PendingKeys out;
    map_.for_each([&](int64_t k, int32_t p) {
      out.keys.push_back(k);
      out.counts.push_back(count_[p]);
      out.last_seen.push_back(ts_[p]);
    });
    return out;
  }

 private:
  KeyRowMap map_;
  std::vector<uint32_t> count_;
  std::vector<int64_t> ts_;
  std::vector<int32_t> free_;
};

}  // namespace shardrec
