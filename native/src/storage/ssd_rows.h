// The SSD tier of a table shard: the store's rows become the memory tier (device and host
// vocabulary together), and a key whose row does not fit there lives in a record of the SSD tier
// (ssd_tier.h). A lookup brings its batch's rows into memory first (bring_in), moving the coldest
// unpinned rows down when the memory tier is full (make_room), so that kernels only ever see memory
// rows; residency.h decides what is pinned and what is coldest. Per memory row it knows the key
// the row holds; per SSD record, the key's count, timestamp and uses, which travel with the row.
// Not thread-safe: the owning EmbeddingIndex holds its lock; the map, memory rows and residency
// it is given are the index's own.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "exchange/channel.h"
#include "index/index_state.h"
#include "index/key_row_map.h"
#include "storage/memory_rows.h"
#include "storage/residency.h"
#include "storage/row_store.h"
#include "storage/ssd_tier.h"

namespace shardrec {

// Where a key's row is: memory row `loc` (< capacity) or SSD record loc - capacity - 1.
struct Locations {
  int32_t capacity;
  bool on_ssd(int32_t loc) const { return loc > capacity; }
  int32_t record_of(int32_t loc) const { return loc - capacity - 1; }
  int32_t of_record(int32_t r) const { return capacity + 1 + r; }
};

class SsdRows {
 public:
  static constexpr int64_t kNoKey = INT64_MIN;

  SsdRows(const std::string& name, int rank, std::vector<std::string> dirs, int64_t records, SwapPolicy policy,
          RowStore* store, KeyRowMap& map, MemoryRows& rows, Residency& residency)
      : name_(name),
        store_(store),
        map_(map),
        rows_(rows),
        residency_(residency),
        at_{rows.capacity()},
        tier_(std::make_unique<SsdTier>(name, rank, std::move(dirs), records)) {
    residency_.resize(static_cast<size_t>(rows.capacity()));
    residency_.set_policy(policy);
    key_of_row_.assign(static_cast<size_t>(rows.capacity()), kNoKey);
  }

  int64_t max_records() const { return tier_->max_records(); }
  size_t in_use() const { return static_cast<size_t>(tier_->in_use()); }
  std::vector<std::string> files() const { return tier_->files(); }
  uint64_t file_bytes() const { return tier_->file_bytes(); }
  void remove_files() { tier_->remove_files(); }
  const TierCounters& counters() const { return counters_; }
  void new_step() { counters_.swapped_in_last_step = counters_.swapped_out_last_step = 0; }

  uint32_t& count(int32_t loc) { return count_[at_.record_of(loc)]; }
  int64_t& last_seen(int32_t loc) { return ts_[at_.record_of(loc)]; }
  uint32_t count(int32_t loc) const { return count_[at_.record_of(loc)]; }
  int64_t last_seen(int32_t loc) const { return ts_[at_.record_of(loc)]; }
  // Whether the row of SSD location `loc` changed since the last checkpoint (row_store.h's flag,
  // which travels with the row between the tiers).
  uint8_t& changed(int32_t loc) { return changed_[at_.record_of(loc)]; }
  uint8_t changed(int32_t loc) const { return changed_[at_.record_of(loc)]; }
  // Every SSD record's flag cleared (a full checkpoint saved them all).
  void clear_changed() { std::fill(changed_.begin(), changed_.end(), 0); }

  // Before a lookup: pins the batch's rows in memory and brings those on SSD in (one batched
  // read), so that the lookup sees memory rows only; with `room_for_new`, makes room for the
  // batch's new keys too, so that a full tier fails before anything moves.
  void bring_in(const int64_t* keys, size_t n, Channel channel, bool room_for_new) {
    channel_ = channel;
    batch_keys_ = n;
    // A lookup outside the exchange's rounds (a restore, a test) is a batch of its own: the pins
    // of a batch whose ticket was already read would not hold.
    if (residency_.ticket(channel) <= store_->gathered(channel)) residency_.begin_batch(channel);
    const size_t fresh = pin_batch(keys, n, channel);
    const size_t m = swap_keys_.size();
    make_room(m + (room_for_new ? fresh : 0));
    if (m > 0) swap_in(channel);
  }

  // A memory row for new key `key` (room made first); `reused` counts a freed row taken again.
  int32_t take_row(int64_t key, uint64_t& reused) {
    make_room(1);
    const bool reuse = rows_.reusing();
    const int32_t s = take_memory_row();
    if (reuse) ++reused;
    store_->reset_row_for_key(s, key);
    key_of_row_[s] = key;
    residency_.arrive(s, 0);
    residency_.touch(s, channel_);
    return s;
  }

  // Restore, once the memory tier is full: a record for `key` holding its fresh row, count 0.
  int32_t place_on_ssd(int64_t key) {
    const int columns = store_->n_columns();
    const int64_t dim = store_->dim();
    tier_->set_floats(columns * dim);
    fresh_.resize(static_cast<size_t>(columns * dim));
    float* fresh_columns[RowStore::kMaxColumns];
    for (int c = 0; c < columns; ++c) {
      fresh_columns[c] = fresh_.data() + c * dim;
      store_->fresh_row(key, c, fresh_columns[c]);
    }
    tier_->reserve(1);
    const int32_t r = tier_->take();
    const int32_t zero = 0;
    tier_->write(&r, &key, &zero, 1, fresh_columns, columns, dim);
    grow_record_meta(r);
    count_[r] = 0;
    ts_[r] = 0;
    uses_[r] = 0;
    changed_[r] = 0;
    return at_.of_record(r);
  }

  // Column `c` of the row at SSD location `loc` (which holds `key`), checked against its key and checksum.
  void read_row(int c, int64_t key, int32_t loc, float* out) const {
    const int32_t r = at_.record_of(loc);
    tier_->read_column(&r, &key, 1, c, store_->dim(), out);
  }
  void write_row(int c, int64_t key, int32_t loc, const float* in) {
    const int32_t r = at_.record_of(loc);
    tier_->write_column(&r, &key, 1, c, store_->dim(), in);
  }

  // The key at `loc` is gone (evicted or erased): a memory row holds no key; an SSD record is free.
  void forget(int32_t loc) {
    if (at_.on_ssd(loc))
      tier_->release(at_.record_of(loc));
    else
      key_of_row_[loc] = kNoKey;
  }

  void clear() {
    tier_->clear();
    std::fill(key_of_row_.begin(), key_of_row_.end(), kNoKey);
    count_.clear();
    ts_.clear();
    uses_.clear();
    changed_.clear();
  }
  size_t memory_bytes() const {
    return key_of_row_.capacity() * (sizeof(int64_t) + 4 * sizeof(uint32_t)) +
           count_.capacity() * (2 * sizeof(uint32_t) + sizeof(int64_t) + sizeof(uint8_t));
  }

 private:
  // Touches the batch's memory rows and lists its distinct keys on SSD (swap_keys_); returns how
  // many of its keys have no row.
  size_t pin_batch(const int64_t* keys, size_t n, Channel channel) {
    swap_keys_.clear();
    size_t fresh = 0;
    constexpr size_t kAhead = 8;
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) map_.prefetch(keys[i + kAhead]);
      const int32_t loc = map_.find(keys[i]);
      if (loc == KeyRowMap::kEmpty) {
        ++counters_.misses;
        ++fresh;
      } else if (!at_.on_ssd(loc)) {
        residency_.touch(loc, channel);
        ++counters_.memory_hits;
      } else {
        ++counters_.ssd_hits;
        swap_keys_.push_back(keys[i]);
      }
    }
    // Several requesters may ask for one key (an uncounted lookup's received keys repeat).
    std::sort(swap_keys_.begin(), swap_keys_.end());
    swap_keys_.erase(std::unique(swap_keys_.begin(), swap_keys_.end()), swap_keys_.end());
    return fresh;
  }

  // Reads the rows of swap_keys_ into free memory rows, one batched read.
  void swap_in(Channel channel) {
    const size_t m = swap_keys_.size();
    swap_records_.resize(m);
    swap_rows_.resize(m);
    for (size_t j = 0; j < m; ++j) {
      swap_records_[j] = at_.record_of(map_.find(swap_keys_[j]));
      swap_rows_[j] = take_memory_row();
    }
    float* columns[RowStore::kMaxColumns];
    for (int c = 0; c < store_->n_columns(); ++c) columns[c] = store_->column(c);
    try {
      tier_->read(swap_records_.data(), swap_keys_.data(), swap_rows_.data(), m, columns, store_->n_columns(),
                  store_->dim());
    } catch (...) {
      rows_.release_all(swap_rows_);
      throw;
    }
    for (size_t j = 0; j < m; ++j) {
      const int32_t s = swap_rows_[j], r = swap_records_[j];
      store_->counts()[s] = count_[r];
      store_->last_seen()[s] = ts_[r];
      store_->changed()[s] = changed_[r];
      map_.set_row_at(map_.probe(swap_keys_[j]), s);
      key_of_row_[s] = swap_keys_[j];
      residency_.arrive(s, uses_[r]);
      residency_.touch(s, channel);
      tier_->release(r);
    }
    counters_.swapped_in += m;
    counters_.swapped_in_last_step += m;
    counters_.bytes_swapped_in += m * static_cast<uint64_t>(tier_->record_bytes());
  }

  // At least `need` free memory rows: the coldest unpinned rows move to SSD, a sixteenth of the
  // memory tier at a time (one scan and one batched write serve many lookups). Throws before
  // moving anything when the SSD tier or the unpinned rows cannot make the room.
  void make_room(size_t need) {
    const size_t avail = rows_.available();
    if (avail >= need) return;
    const size_t want = need - avail;
    const size_t ssd_room = static_cast<size_t>(tier_->max_records() - tier_->in_use());
    if (ssd_room < want) tier_->reserve(static_cast<int64_t>(want));  // throws: the SSD share is used
    const size_t capacity = static_cast<size_t>(at_.capacity);
    const size_t bulk = std::min(std::max(want, capacity / 16), ssd_room);
    const uint32_t gathered[kChannels] = {store_->gathered(Channel::kTrain), store_->gathered(Channel::kEval)};
    const size_t unpinned = residency_.coldest(
        rows_.high(), [this](int32_t s) { return key_of_row_[s] != kNoKey; }, bulk, gathered, victims_);
    if (unpinned < want) throw_pinned(want, unpinned);
    swap_out();
  }

  [[noreturn]] void throw_pinned(size_t want, size_t unpinned) const {
    const std::string rows = std::to_string(at_.capacity);
    if (2 * batch_keys_ > static_cast<size_t>(at_.capacity))
      throw CapacityError("table '" + name_ + "': its memory budget of " + rows +
                          " rows per rank ((device_vocabulary_size + host_vocabulary_size) / ranks) is smaller than "
                          "two batches' distinct keys: one batch brought up to " + std::to_string(batch_keys_) +
                          " keys to this rank; raise host_vocabulary_size to at least " +
                          std::to_string(2 * batch_keys_) + " rows per rank");
    throw CapacityError("table '" + name_ + "': its memory tier (" + rows +
                        " rows on this rank: device_vocabulary_size + host_vocabulary_size over the ranks) cannot "
                        "hold the rows of the batches in flight: " + std::to_string(rows_.high() - unpinned) +
                        " rows belong to batches looked up and not yet trained, and this batch needs " +
                        std::to_string(want) + " more; raise host_vocabulary_size, or prefetch fewer batches");
  }

  // Writes the rows of victims_ to SSD records, one batched write, and frees them.
  void swap_out() {
    const size_t k = victims_.size();
    tier_->set_floats(store_->n_columns() * store_->dim());
    tier_->reserve(static_cast<int64_t>(k));  // a full disk throws here, before any row moves
    swap_records_.resize(k);
    swap_keys_out_.resize(k);
    for (size_t i = 0; i < k; ++i) {
      swap_records_[i] = tier_->take();
      swap_keys_out_[i] = key_of_row_[victims_[i]];
    }
    float* columns[RowStore::kMaxColumns];
    for (int c = 0; c < store_->n_columns(); ++c) columns[c] = store_->column(c);
    tier_->write(swap_records_.data(), swap_keys_out_.data(), victims_.data(), k, columns, store_->n_columns(),
                 store_->dim());
    for (size_t i = 0; i < k; ++i) {
      const int32_t s = victims_[i], r = swap_records_[i];
      grow_record_meta(r);
      count_[r] = store_->counts()[s];
      ts_[r] = store_->last_seen()[s];
      changed_[r] = store_->changed()[s];
      uses_[r] = residency_.uses(s);
      map_.set_row_at(map_.probe(swap_keys_out_[i]), at_.of_record(r));
      key_of_row_[s] = kNoKey;
      rows_.release(s);
    }
    counters_.swapped_out += k;
    counters_.swapped_out_last_step += k;
    counters_.bytes_swapped_out += k * static_cast<uint64_t>(tier_->record_bytes());
  }

  // A free memory row (make_room made sure there is one).
  int32_t take_memory_row() {
    const int32_t s = rows_.take();
    if (s < 0) throw std::logic_error("table '" + name_ + "': no free memory row after make_room");
    return s;
  }

  void grow_record_meta(int32_t r) {
    if (static_cast<size_t>(r) >= count_.size()) {
      const size_t n = std::max<size_t>(static_cast<size_t>(r) + 1, count_.size() * 2);
      count_.resize(n);
      ts_.resize(n);
      uses_.resize(n);
      changed_.resize(n);
    }
  }

  const std::string name_;
  RowStore* const store_;
  KeyRowMap& map_;
  MemoryRows& rows_;
  Residency& residency_;
  const Locations at_;
  std::unique_ptr<SsdTier> tier_;
  std::vector<int64_t> key_of_row_;  // per memory row: its key (kNoKey: free or held back)
  std::vector<uint32_t> count_, uses_;  // per SSD record
  std::vector<int64_t> ts_;
  std::vector<uint8_t> changed_;
  Channel channel_ = Channel::kTrain;  // of the lookup in progress
  size_t batch_keys_ = 0;               // keys of the lookup in progress
  std::vector<int64_t> swap_keys_, swap_keys_out_;
  std::vector<int32_t> swap_records_, swap_rows_, victims_;
  std::vector<float> fresh_;
  TierCounters counters_;
};

}  // namespace shardrec
