// One table shard's key index: which row (slot) of the shard's row store holds each key, which
// rows are free, and the counters users see. Thread-safe: the train and eval pipelines of a
// table run in different TensorFlow threads. A new row beyond the rows in use puts the next chunk
// of the store in use (dynamic expansion), on the pipeline's thread, before any kernel sees it.
#pragma once

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "key_slot_map.h"
#include "row_store.h"

namespace shardrec {

struct IndexCounters {
  uint64_t keys_sent = 0;      // unique batch keys sent to their owners (own rank included)
  uint64_t keys_received = 0;  // keys received as their owner (own rank included)
  uint64_t inserted = 0;       // keys given a new slot
  uint64_t missed = 0;         // unknown keys on a non-allocating (eval) lookup
  uint64_t erased = 0;
};

class EmbeddingIndex {
 public:
  // `capacity`: the rows the shard may hold (the store's rows less the sentinel). The map is sized
  // for `expected` keys here, so that no batch stalls on a rehash (a rehash of a large map inside
  // one batch made inserting batches 5-10x slower than the median): the whole shard for a table
  // of fixed size; with dynamic expansion, the shard's initial size, and it doubles from there.
  EmbeddingIndex(std::string name, int64_t capacity, RowStore* store, int64_t expected, bool expands)
      : name_(std::move(name)), capacity_(static_cast<int32_t>(capacity)), store_(store), expands_(expands) {
    if (capacity < 1 || capacity >= INT32_MAX)
      throw std::invalid_argument("capacity must be in [1, 2^31-2], got " + std::to_string(capacity));
    if (store == nullptr || store->rows() != capacity + 1)
      throw std::invalid_argument("the row store must have capacity + 1 rows");
    store_->ref();
    map_.reserve(static_cast<size_t>(std::max<int64_t>(1, std::min(expected, capacity))));
  }
  ~EmbeddingIndex() { store_->unref(); }
  EmbeddingIndex(const EmbeddingIndex&) = delete;
  EmbeddingIndex& operator=(const EmbeddingIndex&) = delete;

  RowStore& store() { return *store_; }
  bool expands() const { return expands_; }

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
      if (expands_) store_->reset_row(s);
      return s;
    }
    if (next_slot_ >= capacity_) {
      throw CapacityError("table '" + name_ + "': the device tier is full (" + std::to_string(capacity_) +
                          " rows on this rank); raise the table's device_vocabulary_size" +
                          (expands_ ? " or SHARDREC_TABLE_MEMORY_LIMIT" : ", or init(use_dynamic_expansion=True)"));
    }
    store_->ensure_rows(static_cast<int64_t>(next_slot_) + 1);
    return next_slot_++;
  }

  const std::string name_;
  const int32_t capacity_;
  RowStore* const store_;
  const bool expands_;
  mutable std::mutex mu_;
  KeySlotMap map_;
  std::vector<int32_t> free_;
  int32_t next_slot_ = 0;
  IndexCounters counters_;
};

}  // namespace shardrec
