// One table shard's key index: which device-tier row (slot) holds each key, which rows are
// free, and the counters users see. Thread-safe: the train and eval pipelines of a table
// run in different TensorFlow threads.
#pragma once

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "key_slot_map.h"

namespace shardrec {

class CapacityError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct IndexCounters {
  uint64_t keys_sent = 0;      // unique batch keys sent to their owners (own rank included)
  uint64_t keys_received = 0;  // keys received as their owner (own rank included)
  uint64_t inserted = 0;       // keys given a new slot
  uint64_t missed = 0;         // unknown keys on a non-allocating (eval) lookup
  uint64_t erased = 0;
};

class EmbeddingIndex {
 public:
  // The map is sized for the whole shard here, so that no batch stalls on a rehash (a rehash of a
  // large map inside one batch made inserting batches 5-10x slower than the median). It costs
  // 16 bytes per row of capacity, a quarter of a dim-16 row of values, which is allocated too.
  EmbeddingIndex(std::string name, int64_t capacity)
      : name_(std::move(name)), capacity_(static_cast<int32_t>(capacity)) {
    if (capacity < 1 || capacity >= INT32_MAX)
      throw std::invalid_argument("capacity must be in [1, 2^31-2], got " + std::to_string(capacity));
    map_.reserve(static_cast<size_t>(capacity));
  }

  const std::string& name() const { return name_; }
  int32_t capacity() const { return capacity_; }
  // The row that stands for "no row": the table variable keeps it at zero.
  int32_t sentinel() const { return capacity_; }

  size_t size() const {
    std::lock_guard<std::mutex> g(mu_);
    return map_.size();
  }

  IndexCounters counters() const {
    std::lock_guard<std::mutex> g(mu_);
    return counters_;
  }

  size_t memory_bytes() const {
    std::lock_guard<std::mutex> g(mu_);
    return map_.memory_bytes() + free_.capacity() * sizeof(int32_t);
  }

  // Maps keys to slots. allocate=false (eval) never inserts: unknown keys get the sentinel.
  void lookup(const int64_t* keys, size_t n, bool allocate, int32_t* slots) {
    std::lock_guard<std::mutex> g(mu_);
    lookup_locked(keys, n, allocate, slots);
  }

  // Keys this shard sent to owners and received from requesters in one exchange.
  void add_traffic(uint64_t sent, uint64_t received) {
    std::lock_guard<std::mutex> g(mu_);
    counters_.keys_sent += sent;
    counters_.keys_received += received;
  }

  // Frees the rows of `keys`; their slots are reused by later inserts. Returns how many existed.
  size_t erase(const int64_t* keys, size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    size_t removed = 0;
    for (size_t i = 0; i < n; ++i) {
      const int32_t slot = map_.erase(keys[i]);
      if (slot == KeySlotMap::kEmpty) continue;
      free_.push_back(slot);
      ++removed;
    }
    counters_.erased += removed;
    return removed;
  }

  // Forgets every key; counters are kept. The map keeps its size (room for the whole shard).
  void clear() {
    std::lock_guard<std::mutex> g(mu_);
    map_.clear();
    free_.clear();
    free_.shrink_to_fit();
    next_slot_ = 0;
  }

  // Every (key, slot) pair, in slot order so exports are reproducible.
  void export_pairs(std::vector<int64_t>& keys, std::vector<int32_t>& slots) const {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<int64_t> by_slot(next_slot_);
    std::vector<char> used(next_slot_, 0);
    map_.for_each([&](int64_t k, int32_t s) {
      by_slot[s] = k;
      used[s] = 1;
    });
    keys.clear();
    slots.clear();
    keys.reserve(map_.size());
    slots.reserve(map_.size());
    for (int32_t s = 0; s < next_slot_; ++s) {
      if (!used[s]) continue;
      keys.push_back(by_slot[s]);
      slots.push_back(s);
    }
  }

 private:
  void lookup_locked(const int64_t* keys, size_t n, bool allocate, int32_t* slots) {
    for (size_t i = 0; i < n; ++i) {
      const size_t b = map_.probe(keys[i]);
      if (map_.occupied(b)) {
        slots[i] = map_.slot_at(b);
      } else if (!allocate) {
        slots[i] = sentinel();
        ++counters_.missed;
      } else {
        const int32_t slot = take_slot();
        map_.insert_at(b, keys[i], slot);
        slots[i] = slot;
        ++counters_.inserted;
      }
    }
  }

  int32_t take_slot() {
    if (!free_.empty()) {
      const int32_t s = free_.back();
      free_.pop_back();
      return s;
    }
    if (next_slot_ >= capacity_) {
      throw CapacityError("table '" + name_ + "': the device tier is full (" + std::to_string(capacity_) +
                          " rows on this rank); raise the table's device_vocabulary_size");
    }
    return next_slot_++;
  }

  const std::string name_;
  const int32_t capacity_;
  mutable std::mutex mu_;
  KeySlotMap map_;
  std::vector<int32_t> free_;
  int32_t next_slot_ = 0;
  IndexCounters counters_;
};

}  // namespace shardrec
