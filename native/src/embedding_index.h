// One table shard's key index: which row (slot) of the shard's row store holds each key, which
// rows are free, and the counters users see. With admission (access_threshold >= 0) it also counts
// the keys that have no row yet (a second map, key -> count and last-seen timestamp) and gives a
// key a row once its count reaches the threshold; with eviction it frees the rows of keys whose
// last-seen timestamp is old enough, holding each freed row back until the training step has
// passed every batch that may still reference it (release_evicted).
//
// The input pipeline looks batches up ahead of training, so when a checkpoint is saved after step T
// the index has already counted (and admitted, and maybe evicted for) batches T, T+1, ...: a journal
// of each step's changes lets export_as_of(T) give the state as of step T exactly, which is what a
// restore at step T must resume from. Thread-safe: the train and eval pipelines of a
// table run in different TensorFlow threads. A new row beyond the rows in use puts the next chunk
// of the store in use (dynamic expansion), on the pipeline's thread, before any kernel sees it.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "array_file.h"
#include "key_slot_map.h"
#include "residency.h"
#include "row_store.h"
#include "ssd_tier.h"

namespace shardrec {

struct IndexCounters {
  uint64_t keys_sent = 0;      // unique batch keys sent to their owners (own rank included)
  uint64_t keys_received = 0;  // keys received as their owner (own rank included)
  uint64_t inserted = 0;       // keys given a new slot
  uint64_t missed = 0;         // unknown keys on a non-allocating (eval) lookup
  uint64_t erased = 0;
  uint64_t admitted = 0;         // keys given a row because their count reached the threshold
  uint64_t rejected = 0;         // training occurrences of keys that had no row yet (read zeros, no update)
  uint64_t evicted = 0;          // keys whose row eviction freed
  uint64_t evicted_pending = 0;  // keys still counting towards admission that eviction forgot
  uint64_t reused = 0;           // freed rows taken again (fresh initial values)
};

// A table with an SSD tier: where its keys were found and what moved.
struct TierCounters {
  uint64_t memory_hits = 0;  // keys looked up whose row was in memory
  uint64_t ssd_hits = 0;     // keys looked up whose row was on SSD (and was swapped in)
  uint64_t misses = 0;       // keys looked up that had no row (new, pending or unknown)
  uint64_t swapped_in = 0, swapped_out = 0;  // rows
  uint64_t bytes_in = 0, bytes_out = 0;
  uint64_t step_in = 0, step_out = 0;  // rows moved since the last training batch began (its step)
};

// A key that has no row yet, as a checkpoint holds it.
struct PendingKeys {
  std::vector<int64_t> keys, last_seen;
  std::vector<uint32_t> counts;
};

// The keys of a counting table as of one step: rows (in row order) and keys still counting.
struct AdmissionState {
  std::vector<int64_t> keys, last_seen;
  std::vector<int32_t> slots;
  std::vector<uint32_t> counts;
  PendingKeys pending;
  int64_t newest = -1;
  bool exact = true;  // false: the journal no longer reached back to the step asked for
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
  int64_t dim() const { return store_->dim(); }
  bool expands() const { return expands_; }

  // An SSD tier of `records` rows under `dirs`: the store's rows become the memory tier (device and
  // host vocabulary together), and a key whose row does not fit there lives on SSD; a lookup brings
  // its batch's rows into memory first (bring_in), moving the coldest unpinned rows down when the
  // memory tier is full (make_room). A key on SSD maps to location capacity() + 1 + its record.
  void set_ssd(int64_t records, std::vector<std::string> dirs, int rank, SwapPolicy policy) {
    std::lock_guard<std::mutex> g(mu_);
    if (map_.size() > 0 || next_slot_ > 0) throw std::logic_error("the SSD tier is set before the first key");
    if (records < 1 || static_cast<int64_t>(capacity_) + 1 + records >= INT32_MAX)
      throw std::invalid_argument("SSD rows must be in [1, 2^31 - 2 - memory rows], got " + std::to_string(records));
    ssd_ = std::make_unique<SsdTier>(name_, rank, std::move(dirs), records);
    residency_.resize(static_cast<size_t>(capacity_));
    residency_.set_policy(policy);
    slot_key_.assign(static_cast<size_t>(capacity_), kNoKey);
  }
  bool tiered() const { return ssd_ != nullptr; }
  // Keys the shard may hold: its memory rows and its SSD rows.
  int64_t max_keys() const { return capacity_ + (ssd_ ? ssd_->max_records() : 0); }
  size_t rows_on_ssd() const {
    std::lock_guard<std::mutex> g(mu_);
    return ssd_ ? static_cast<size_t>(ssd_->in_use()) : 0;
  }
  TierCounters tier_counters() const {
    std::lock_guard<std::mutex> g(mu_);
    return tier_;
  }
  std::vector<std::string> ssd_files() const {
    std::lock_guard<std::mutex> g(mu_);
    return ssd_ ? ssd_->files() : std::vector<std::string>{};
  }
  uint64_t ssd_file_bytes() const {
    std::lock_guard<std::mutex> g(mu_);
    return ssd_ ? ssd_->file_bytes() : 0;
  }
  // Removes the SSD tier's files (a clean shutdown); the tier is empty afterwards.
  void close_ssd() {
    std::lock_guard<std::mutex> g(mu_);
    if (ssd_) ssd_->remove_files();
  }

  // A new batch of a channel (0 train, 1 eval), once per exchange round: its ticket, which the
  // lookup's row gather reports when it reads the batch's rows (residency.h).
  uint32_t begin_batch(int channel) {
    std::lock_guard<std::mutex> g(mu_);
    if (channel == 0) tier_.step_in = tier_.step_out = 0;
    return residency_.begin_batch(channel);
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
    return map_.memory_bytes() + free_.capacity() * sizeof(int32_t) + pending_.memory_bytes() +
           slot_key_.capacity() * (sizeof(int64_t) + 4 * sizeof(uint32_t)) +
           ssd_count_.capacity() * (2 * sizeof(uint32_t) + sizeof(int64_t)) +
           pend_count_.capacity() * sizeof(uint32_t) + pend_ts_.capacity() * sizeof(int64_t) +
           pend_free_.capacity() * sizeof(int32_t) + quarantine_.capacity() * sizeof(quarantine_[0]);
  }

  // Maps keys to slots. allocate=false (eval) never inserts: unknown keys get the sentinel.
  void lookup(const int64_t* keys, size_t n, bool allocate, int32_t* slots) {
    std::lock_guard<std::mutex> g(mu_);
    if (ssd_) bring_in(keys, n, allocate ? 0 : 1, allocate);
    lookup_locked(keys, n, allocate, slots);
  }

  // Restore: a location for each of `keys` (distinct, none held yet), memory first, then SSD, with
  // fresh rows (values drawn from the key, slots at their initial values) that write_rows fills.
  void place(const int64_t* keys, size_t n, int32_t* locs) {
    std::lock_guard<std::mutex> g(mu_);
    if (!ssd_) {
      lookup_locked(keys, n, true, locs);
      return;
    }
    const int columns = store_->n_columns();
    ssd_->set_floats(columns * store_->dim());
    std::vector<std::vector<float>> fresh(static_cast<size_t>(columns), std::vector<float>(store_->dim()));
    float* fresh_columns[RowStore::kMaxColumns];
    for (int c = 0; c < columns; ++c) fresh_columns[c] = fresh[c].data();
    const int32_t zero = 0;
    for (size_t i = 0; i < n; ++i) {
      const size_t b = map_.probe(keys[i]);
      if (map_.occupied(b)) throw std::invalid_argument("key " + std::to_string(keys[i]) + " is restored twice");
      if (!free_.empty() || next_slot_ < capacity_) {
        locs[i] = take_slot(keys[i]);
      } else {
        ssd_->reserve(1);
        const int32_t r = ssd_->take();
        for (int c = 0; c < columns; ++c) store_->fresh_row(keys[i], c, fresh_columns[c]);
        ssd_->write(&r, &keys[i], &zero, 1, fresh_columns, columns, store_->dim());
        ssd_meta(r);
        ssd_count_[r] = 0;
        ssd_ts_[r] = 0;
        ssd_uses_[r] = 0;
        locs[i] = loc_of_record(r);
      }
      map_.insert_at(map_.probe(keys[i]), keys[i], locs[i]);
      ++counters_.inserted;
    }
  }

  // Column `c` of the rows at `locs` (which hold `keys`) / written from `in`: memory rows in the
  // store, SSD rows in their records (checked against their keys and checksums).
  void read_rows(int c, const int64_t* keys, const int32_t* locs, size_t n, float* out) const {
    std::lock_guard<std::mutex> g(mu_);
    read_rows_locked(c, keys, locs, n, out);
  }

  // A checkpoint's view: every key (as of training step `step`, or as the index is when `as_of` is
  // false) with the rows of `columns`, taken under one hold of the lock, so that no lookup of the
  // input pipeline (which may move rows between tiers) comes between the keys and their rows.
  struct Snapshot {
    AdmissionState state;
    std::vector<std::vector<float>> columns;
  };

  // The same view written to disk instead: column columns[j] to paths[j] as an .npy file
  // (array_file.h), `chunk_rows` rows at a time, so that the rows of every tier pass through one
  // chunk of memory. The keys and admission state come back for the caller to write.
  struct SavedColumns {
    AdmissionState state;
    std::vector<FileDigest> files;
  };
  SavedColumns save_columns(bool as_of, int64_t step, const std::vector<int>& columns,
                            const std::vector<std::string>& paths, size_t chunk_rows) const {
    std::lock_guard<std::mutex> g(mu_);
    SavedColumns out;
    export_state_locked(as_of, step, out.state);
    const size_t n = out.state.keys.size(), dim = static_cast<size_t>(store_->dim());
    chunk_rows = std::max<size_t>(1, std::min(chunk_rows, n));
    std::vector<float> chunk(chunk_rows * dim);
    const std::string header = npy_header("<f4", {static_cast<int64_t>(n), static_cast<int64_t>(dim)});
    for (size_t j = 0; j < columns.size(); ++j) {
      ArrayFileWriter file(paths.at(j), header);
      for (size_t b = 0; b < n; b += chunk_rows) {
        const size_t m = std::min(chunk_rows, n - b);
        read_rows_locked(columns[j], out.state.keys.data() + b, out.state.slots.data() + b, m, chunk.data());
        file.write(chunk.data(), m * dim * sizeof(float));
      }
      out.files.push_back(file.finish());
    }
    return out;
  }
  Snapshot snapshot(bool as_of, int64_t step, const std::vector<int>& columns) const {
    std::lock_guard<std::mutex> g(mu_);
    Snapshot out;
    export_state_locked(as_of, step, out.state);
    const size_t n = out.state.keys.size();
    for (int c : columns) {
      out.columns.emplace_back(n * static_cast<size_t>(store_->dim()));
      read_rows_locked(c, out.state.keys.data(), out.state.slots.data(), n, out.columns.back().data());
    }
    return out;
  }

 private:
  void read_rows_locked(int c, const int64_t* keys, const int32_t* locs, size_t n, float* out) const {
    if (!ssd_) {
      store_->read_rows(c, locs, static_cast<int64_t>(n), out);
      return;
    }
    const int64_t dim = store_->dim();
    for (size_t i = 0; i < n; ++i) {
      if (on_ssd(locs[i])) {
        const int32_t r = record_of(locs[i]);
        ssd_->read_column(&r, &keys[i], 1, c, dim, out + i * dim);
      } else {
        std::memcpy(out + i * dim, store_->column(c) + static_cast<int64_t>(locs[i]) * dim, dim * sizeof(float));
      }
    }
  }

 public:
  void write_rows(int c, const int64_t* keys, const int32_t* locs, size_t n, const float* in) {
    std::lock_guard<std::mutex> g(mu_);
    const int64_t dim = store_->dim();
    for (size_t i = 0; i < n; ++i) {
      if (on_ssd(locs[i])) {
        const int32_t r = record_of(locs[i]);
        ssd_->write_column(&r, &keys[i], 1, c, dim, in + i * dim);
      } else {
        std::memcpy(store_->column(c) + static_cast<int64_t>(locs[i]) * dim, in + i * dim, dim * sizeof(float));
      }
    }
  }

  // Admission and eviction, set before the first batch. access < 0: every key gets a row at once
  // and nothing is counted; eviction < 0: nothing is evicted.
  void set_admission(int64_t access, int64_t eviction) {
    std::lock_guard<std::mutex> g(mu_);
    access_ = access;
    eviction_ = eviction;
  }
  bool counts() const { return access_ >= 0; }
  bool evicts() const { return eviction_ >= 0; }
  int64_t access_threshold() const { return access_; }
  int64_t eviction_threshold() const { return eviction_; }
  // The newest data timestamp any rank has seen for this table (-1: none yet).
  int64_t newest() const {
    std::lock_guard<std::mutex> g(mu_);
    return newest_;
  }
  void observe_newest(int64_t ts) {
    std::lock_guard<std::mutex> g(mu_);
    newest_ = std::max(newest_, ts);
  }
  size_t pending() const {
    std::lock_guard<std::mutex> g(mu_);
    return pending_.size();
  }
  size_t held_back() const {
    std::lock_guard<std::mutex> g(mu_);
    return quarantine_.size();
  }

  // A training lookup with admission: meta[2i] is how often keys[i] occurs in the batch (all
  // requesters together), meta[2i+1] its newest timestamp (0 without a timestamp feature). Keys
  // with a row are counted; a key without one is counted towards admission and gets a row once its
  // count reaches the threshold, else the sentinel (zeros, no update).
  void lookup_counted(const int64_t* keys, const int64_t* meta, size_t n, int32_t* slots) {
    std::lock_guard<std::mutex> g(mu_);
    if (ssd_) bring_in(keys, n, 0, false);  // few new keys are admitted: room is made as they are
    uint32_t* counts = store_->counts();
    int64_t* last_seen = store_->last_seen();
    std::vector<Change>* log = journal_.empty() ? nullptr : &journal_.back().looked_up;
    // Two passes, each prefetching a few keys ahead: the map's buckets, then the rows' metadata
    // (the keys are distinct, so what the first pass finds holds through the second).
    constexpr size_t kAhead = 8;
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) map_.prefetch(keys[i + kAhead]);
      const size_t b = map_.probe(keys[i]);
      slots[i] = map_.occupied(b) ? map_.slot_at(b) : KeySlotMap::kEmpty;
      if (slots[i] != KeySlotMap::kEmpty && on_ssd(slots[i]))
        throw std::logic_error("table '" + name_ + "': a row of this batch is not in memory");
    }
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) {
        const int32_t ahead = slots[i + kAhead];
        if (ahead != KeySlotMap::kEmpty) {
          __builtin_prefetch(counts + ahead);
          __builtin_prefetch(last_seen + ahead);
        } else {
          pending_.prefetch(keys[i + kAhead]);
        }
      }
      const int64_t c = meta[2 * i], ts = meta[2 * i + 1];
      const int32_t s = slots[i];
      if (s != KeySlotMap::kEmpty) {
        if (log != nullptr) log->push_back(Change{keys[i], last_seen[s], counts[s], s, kRow});
        counts[s] = saturated(counts[s] + static_cast<uint64_t>(c));
        last_seen[s] = std::max(last_seen[s], ts);
        continue;
      }
      const size_t pb = pending_.probe(keys[i]);
      const bool known = pending_.occupied(pb);
      const int32_t p = known ? pending_.slot_at(pb) : -1;
      const uint64_t total = static_cast<uint64_t>(c) + (known ? pend_count_[p] : 0);
      const int64_t seen = std::max(ts, known ? pend_ts_[p] : INT64_MIN);
      if (log != nullptr)
        log->push_back(known ? Change{keys[i], pend_ts_[p], pend_count_[p], -1, kPending} : Change{keys[i], 0, 0, -1, kAbsent});
      if (static_cast<int64_t>(total) >= access_) {
        const int32_t slot = take_slot(keys[i]);
        map_.insert_at(map_.probe(keys[i]), keys[i], slot);
        counts[slot] = saturated(total);
        last_seen[slot] = seen;
        if (known) forget_pending(keys[i], p);
        slots[i] = slot;
        ++counters_.inserted;
        ++counters_.admitted;
      } else {
        if (known) {
          pend_count_[p] = saturated(total);
          pend_ts_[p] = seen;
        } else {
          add_pending(pb, keys[i], total, seen);
        }
        slots[i] = sentinel();
        counters_.rejected += static_cast<uint64_t>(c);
      }
    }
  }

  // The exchange starts a step's journal before the step's eviction and lookups.
  void begin_step(int64_t step) {
    std::lock_guard<std::mutex> g(mu_);
    if (!journal_.empty() && journal_.back().step >= step) journal_.clear();  // the steps started again (restore)
    while (journal_.size() >= kJournalSteps) {
      dropped_upto_ = journal_.front().step;
      retire_oldest_step();
    }
    // A retired step's buffers, kept: a fresh megabyte a step cost page faults on every batch.
    StepJournal j;
    if (!spare_.empty()) {
      j = std::move(spare_.back());
      spare_.pop_back();
    }
    j.step = step;
    j.newest_before = newest_;
    j.evicted.clear();
    j.looked_up.clear();
    journal_.push_back(std::move(j));
  }

  // Evicts every key (with a row or still counting) whose last-seen timestamp is at least the
  // eviction threshold older than the newest one. Freed rows are held back, tagged with `step`
  // (the training steps whose batches were looked up before this eviction): release_evicted frees
  // them once training has passed that step. Returns the number of keys with a row evicted.
  size_t evict(int64_t step) {
    std::lock_guard<std::mutex> g(mu_);
    if (eviction_ < 0 || newest_ < 0) return 0;
    const int64_t cutoff = newest_ - eviction_;
    const int64_t* last_seen = store_->last_seen();
    const int32_t memory_rows = capacity_;
    std::vector<int64_t> old;
    // A scan of every bucket: each held key's timestamp is a random access into the store's
    // metadata, prefetched a few buckets ahead.
    constexpr size_t kAhead = 16;
    const size_t buckets = map_.bucket_count();
    for (size_t b = 0; b < buckets; ++b) {
      if (b + kAhead < buckets && map_.occupied(b + kAhead) && map_.slot_at(b + kAhead) < memory_rows)
        __builtin_prefetch(last_seen + map_.slot_at(b + kAhead));
      if (map_.occupied(b) && ts_at(map_.slot_at(b)) <= cutoff) old.push_back(map_.key_at(b));
    }
    std::vector<Change>* log = journal_.empty() ? nullptr : &journal_.back().evicted;
    for (size_t i = 0; i < old.size(); ++i) {
      if (i + 8 < old.size()) map_.prefetch(old[i + 8]);
      const int64_t k = old[i];
      const int32_t s = map_.erase(k);
      if (log != nullptr) log->push_back(Change{k, ts_at(s), count_at(s), s, kRow});
      if (ssd_ && !on_ssd(s)) slot_key_[s] = kNoKey;
      quarantine_.emplace_back(step, s);
    }
    counters_.evicted += old.size();
    const size_t rows = old.size();
    old.clear();
    pending_.for_each([&](int64_t k, int32_t p) {
      if (pend_ts_[p] <= cutoff) old.push_back(k);
    });
    for (int64_t k : old) {
      const int32_t p = pending_.find(k);
      if (log != nullptr) log->push_back(Change{k, pend_ts_[p], pend_count_[p], -1, kPending});
      forget_pending(k, p);
    }
    counters_.evicted_pending += old.size();
    return rows;
  }

  // Called with the global step after each training step. Frees the rows evicted at steps
  // < trained_step: every batch looked up before their eviction is trained, and a checkpoint of
  // step trained_step no longer needs their values (an eviction at step T itself is undone by
  // export_as_of(T)). Drops the journal of steps < trained_step. Returns how many rows became free.
  size_t release_evicted(int64_t trained_step) {
    std::lock_guard<std::mutex> g(mu_);
    while (!journal_.empty() && journal_.front().step < trained_step) retire_oldest_step();
    size_t n = 0;
    for (; n < quarantine_.size() && quarantine_[n].first < trained_step; ++n) free_location(quarantine_[n].second);
    quarantine_.erase(quarantine_.begin(), quarantine_.begin() + static_cast<std::ptrdiff_t>(n));
    return n;
  }

  // Counts and last-seen timestamps of `slots` (a checkpoint's rows) / set from one.
  void read_metadata(const int32_t* slots, size_t n, uint32_t* counts, int64_t* last_seen) const {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < n; ++i) {
      counts[i] = count_at(slots[i]);
      last_seen[i] = ts_at(slots[i]);
    }
  }
  void write_metadata(const int32_t* slots, size_t n, const uint32_t* counts, const int64_t* last_seen) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < n; ++i) {
      count_at(slots[i]) = counts[i];
      ts_at(slots[i]) = last_seen[i];
    }
  }
  // Every key as of step `step`: the current keys with the journal of steps >= step undone (in
  // reverse: each step's lookups, then its eviction, which came first). Rows of keys admitted
  // since have no place in it; rows evicted since are held back, their values those of step `step`.
  AdmissionState export_as_of(int64_t step) const {
    std::lock_guard<std::mutex> g(mu_);
    return export_as_of_locked(step);
  }
  // Every (key, slot) pair, in slot order so exports are reproducible.
  void export_pairs(std::vector<int64_t>& keys, std::vector<int32_t>& slots) const {
    std::lock_guard<std::mutex> g(mu_);
    export_pairs_locked(keys, slots);
  }

 private:
  AdmissionState export_as_of_locked(int64_t step) const {
    struct Entry {
      int32_t slot;
      uint32_t count;
      int64_t ts;
    };
    std::unordered_map<int64_t, Entry> rows, pending;
    rows.reserve(map_.size());
    map_.for_each([&](int64_t k, int32_t s) { rows[k] = Entry{s, count_at(s), ts_at(s)}; });
    pending_.for_each([&](int64_t k, int32_t p) { pending[k] = Entry{-1, pend_count_[p], pend_ts_[p]}; });
    AdmissionState out;
    out.newest = newest_;
    out.exact = dropped_upto_ < step;
    for (auto j = journal_.rbegin(); j != journal_.rend() && j->step >= step; ++j) {
      for (auto c = j->looked_up.rbegin(); c != j->looked_up.rend(); ++c) {
        if (c->was == kRow) {
          Entry& e = rows.at(c->key);
          e.count = c->count;
          e.ts = c->ts;
          continue;
        }
        rows.erase(c->key);
        pending.erase(c->key);
        if (c->was == kPending) pending[c->key] = Entry{-1, c->count, c->ts};
      }
      for (auto c = j->evicted.rbegin(); c != j->evicted.rend(); ++c)
        (c->was == kRow ? rows : pending)[c->key] = Entry{c->slot, c->count, c->ts};
      out.newest = j->newest_before;
    }
    std::vector<std::pair<int32_t, int64_t>> order;
    order.reserve(rows.size());
    for (const auto& [k, e] : rows) order.emplace_back(e.slot, k);
    std::sort(order.begin(), order.end());
    for (const auto& [s, k] : order) {
      const Entry& e = rows[k];
      out.keys.push_back(k);
      out.slots.push_back(s);
      out.counts.push_back(e.count);
      out.last_seen.push_back(e.ts);
    }
    std::vector<int64_t> pkeys;
    for (const auto& kv : pending) pkeys.push_back(kv.first);
    std::sort(pkeys.begin(), pkeys.end());
    for (int64_t k : pkeys) {
      out.pending.keys.push_back(k);
      out.pending.counts.push_back(pending[k].count);
      out.pending.last_seen.push_back(pending[k].ts);
    }
    return out;
  }


 public:
  PendingKeys export_pending() const {
    std::lock_guard<std::mutex> g(mu_);
    PendingKeys out;
    pending_.for_each([&](int64_t k, int32_t p) {
      out.keys.push_back(k);
      out.counts.push_back(pend_count_[p]);
      out.last_seen.push_back(pend_ts_[p]);
    });
    return out;
  }
  // Keys still counting, from a checkpoint; a key that has a row is refused.
  void import_pending(const int64_t* keys, const uint32_t* counts, const int64_t* last_seen, size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < n; ++i) {
      if (map_.find(keys[i]) != KeySlotMap::kEmpty)
        throw std::invalid_argument("key " + std::to_string(keys[i]) + " is both admitted and pending");
      const size_t pb = pending_.probe(keys[i]);
      if (pending_.occupied(pb)) {
        pend_count_[pending_.slot_at(pb)] = counts[i];
        pend_ts_[pending_.slot_at(pb)] = last_seen[i];
      } else {
        add_pending(pb, keys[i], counts[i], last_seen[i]);
      }
    }
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
      free_location(slot);
      ++removed;
    }
    counters_.erased += removed;
    return removed;
  }

  // Forgets every key (those still counting and the rows held back too); counters are kept. The
  // map keeps its size (room for the whole shard).
  void clear() {
    std::lock_guard<std::mutex> g(mu_);
    map_.clear();
    free_.clear();
    free_.shrink_to_fit();
    pending_.clear();
    pend_count_.clear();
    pend_ts_.clear();
    pend_free_.clear();
    quarantine_.clear();
    journal_.clear();
    dropped_upto_ = INT64_MIN;
    newest_ = -1;
    next_slot_ = 0;
    if (ssd_) {
      ssd_->clear();
      std::fill(slot_key_.begin(), slot_key_.end(), kNoKey);
      ssd_count_.clear();
      ssd_ts_.clear();
      ssd_uses_.clear();
    }
  }

 private:
  // Every key and its location, as of training step `step` (with the admission state) or as the
  // index is now (as_of false: keys and locations alone).
  void export_state_locked(bool as_of, int64_t step, AdmissionState& state) const {
    if (as_of)
      state = export_as_of_locked(step);
    else
      export_pairs_locked(state.keys, state.slots);
  }

  void export_pairs_locked(std::vector<int64_t>& keys, std::vector<int32_t>& slots) const {
    keys.clear();
    slots.clear();
    keys.reserve(map_.size());
    slots.reserve(map_.size());
    if (!ssd_) {  // memory rows alone: placed by row, no sort
      std::vector<int64_t> by_slot(next_slot_);
      std::vector<char> used(next_slot_, 0);
      map_.for_each([&](int64_t k, int32_t s) {
        by_slot[s] = k;
        used[s] = 1;
      });
      for (int32_t s = 0; s < next_slot_; ++s) {
        if (!used[s]) continue;
        keys.push_back(by_slot[s]);
        slots.push_back(s);
      }
      return;
    }
    std::vector<std::pair<int32_t, int64_t>> pairs;
    pairs.reserve(map_.size());
    map_.for_each([&](int64_t k, int32_t s) { pairs.emplace_back(s, k); });
    std::sort(pairs.begin(), pairs.end());
    for (const auto& [s, k] : pairs) {
      keys.push_back(k);
      slots.push_back(s);
    }
  }

  void lookup_locked(const int64_t* keys, size_t n, bool allocate, int32_t* slots) {
    for (size_t i = 0; i < n; ++i) {
      const size_t b = map_.probe(keys[i]);
      if (map_.occupied(b)) {
        slots[i] = map_.slot_at(b);
        if (on_ssd(slots[i])) throw std::logic_error("table '" + name_ + "': a row of this batch is not in memory");
      } else if (!allocate) {
        slots[i] = sentinel();
        ++counters_.missed;
      } else {
        const int32_t slot = take_slot(keys[i]);
        map_.insert_at(b, keys[i], slot);  // moving rows down (take_slot) changes slots, not buckets
        slots[i] = slot;
        ++counters_.inserted;
      }
    }
  }

  // Tiers: a location is a memory row (< capacity_) or an SSD record (> capacity_).
  static constexpr int64_t kNoKey = INT64_MIN;
  bool on_ssd(int32_t loc) const { return loc > capacity_; }
  int32_t record_of(int32_t loc) const { return loc - capacity_ - 1; }
  int32_t loc_of_record(int32_t r) const { return capacity_ + 1 + r; }
  uint32_t& count_at(int32_t loc) { return on_ssd(loc) ? ssd_count_[record_of(loc)] : store_->counts()[loc]; }
  int64_t& ts_at(int32_t loc) { return on_ssd(loc) ? ssd_ts_[record_of(loc)] : store_->last_seen()[loc]; }
  uint32_t count_at(int32_t loc) const { return on_ssd(loc) ? ssd_count_[record_of(loc)] : store_->counts()[loc]; }
  int64_t ts_at(int32_t loc) const { return on_ssd(loc) ? ssd_ts_[record_of(loc)] : store_->last_seen()[loc]; }
  void ssd_meta(int32_t r) {
    if (static_cast<size_t>(r) >= ssd_count_.size()) {
      const size_t n = std::max<size_t>(static_cast<size_t>(r) + 1, ssd_count_.size() * 2);
      ssd_count_.resize(n);
      ssd_ts_.resize(n);
      ssd_uses_.resize(n);
    }
  }

  void free_location(int32_t loc) {
    if (!on_ssd(loc)) {
      if (ssd_) slot_key_[loc] = kNoKey;
      free_.push_back(loc);
    } else {
      ssd_->release(record_of(loc));
    }
  }

  // Before a lookup of a table with an SSD tier: pins the batch's rows in memory and brings those
  // on SSD in (one batched read), so that the lookup sees memory rows only; with `room_for_new`,
  // makes room for the batch's new keys too, so that a full tier fails before anything moves.
  void bring_in(const int64_t* keys, size_t n, int channel, bool room_for_new) {
    channel_ = channel;
    batch_keys_ = n;
    // A lookup outside the exchange's rounds (a restore, a test) is a batch of its own: the pins
    // of a batch whose ticket was already read would not hold.
    if (residency_.ticket(channel) <= store_->gathered(channel)) residency_.begin_batch(channel);
    swap_keys_.clear();
    size_t fresh = 0;
    constexpr size_t kAhead = 8;
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) map_.prefetch(keys[i + kAhead]);
      const int32_t loc = map_.find(keys[i]);
      if (loc == KeySlotMap::kEmpty) {
        ++tier_.misses;
        ++fresh;
      } else if (!on_ssd(loc)) {
        residency_.touch(loc, channel);
        ++tier_.memory_hits;
      } else {
        ++tier_.ssd_hits;
        swap_keys_.push_back(keys[i]);
      }
    }
    // Several requesters may ask for one key (an uncounted lookup's received keys repeat).
    std::sort(swap_keys_.begin(), swap_keys_.end());
    swap_keys_.erase(std::unique(swap_keys_.begin(), swap_keys_.end()), swap_keys_.end());
    const size_t m = swap_keys_.size();
    make_room(m + (room_for_new ? fresh : 0));
    if (m == 0) return;
    swap_records_.resize(m);
    swap_rows_.resize(m);
    for (size_t j = 0; j < m; ++j) {
      swap_records_[j] = record_of(map_.find(swap_keys_[j]));
      swap_rows_[j] = take_memory_row();
    }
    float* columns[RowStore::kMaxColumns];
    for (int c = 0; c < store_->n_columns(); ++c) columns[c] = store_->column(c);
    try {
      ssd_->read(swap_records_.data(), swap_keys_.data(), swap_rows_.data(), m, columns, store_->n_columns(),
                 store_->dim());
    } catch (...) {
      free_.insert(free_.end(), swap_rows_.begin(), swap_rows_.end());
      throw;
    }
    for (size_t j = 0; j < m; ++j) {
      const int32_t s = swap_rows_[j], r = swap_records_[j];
      store_->counts()[s] = ssd_count_[r];
      store_->last_seen()[s] = ssd_ts_[r];
      map_.set_slot_at(map_.probe(swap_keys_[j]), s);
      slot_key_[s] = swap_keys_[j];
      residency_.arrive(s, ssd_uses_[r]);
      residency_.touch(s, channel);
      ssd_->release(r);
    }
    tier_.swapped_in += m;
    tier_.step_in += m;
    tier_.bytes_in += m * static_cast<uint64_t>(ssd_->record_bytes());
  }

  // At least `need` free memory rows: the coldest unpinned rows move to SSD, a sixteenth of the
  // memory tier at a time (one scan and one batched write serve many lookups). Throws before
  // moving anything when the SSD tier or the unpinned rows cannot make the room.
  void make_room(size_t need) {
    const size_t avail = free_.size() + static_cast<size_t>(capacity_ - next_slot_);
    if (avail >= need) return;
    const size_t want = need - avail;
    const size_t ssd_room = static_cast<size_t>(ssd_->max_records() - ssd_->in_use());
    if (ssd_room < want) ssd_->reserve(static_cast<int64_t>(want));  // throws: the SSD share is used
    const size_t bulk = std::min(std::max(want, static_cast<size_t>(capacity_) / 16), ssd_room);
    const uint32_t gathered[2] = {store_->gathered(0), store_->gathered(1)};
    const size_t unpinned = residency_.coldest(
        next_slot_, [this](int32_t s) { return slot_key_[s] != kNoKey; }, bulk, gathered, victims_);
    if (unpinned < want && 2 * batch_keys_ > static_cast<size_t>(capacity_)) {
      throw CapacityError("table '" + name_ + "': its memory budget of " + std::to_string(capacity_) +
                          " rows per rank ((device_vocabulary_size + host_vocabulary_size) / ranks) is smaller than "
                          "two batches' distinct keys: one batch brought up to " + std::to_string(batch_keys_) +
                          " keys to this rank; raise host_vocabulary_size to at least " +
                          std::to_string(2 * batch_keys_) + " rows per rank");
    }
    if (unpinned < want) {
      throw CapacityError("table '" + name_ + "': its memory tier (" + std::to_string(capacity_) +
                          " rows on this rank: device_vocabulary_size + host_vocabulary_size over the ranks) cannot "
                          "hold the rows of the batches in flight: " + std::to_string(next_slot_ - unpinned) +
                          " rows belong to batches looked up and not yet trained, and this batch needs " +
                          std::to_string(want) + " more; raise host_vocabulary_size, or prefetch fewer batches");
    }
    const size_t k = victims_.size();
    ssd_->set_floats(store_->n_columns() * store_->dim());
    ssd_->reserve(static_cast<int64_t>(k));  // a full disk throws here, before any row moves
    swap_records_.resize(k);
    swap_keys_out_.resize(k);
    for (size_t i = 0; i < k; ++i) {
      swap_records_[i] = ssd_->take();
      swap_keys_out_[i] = slot_key_[victims_[i]];
    }
    float* columns[RowStore::kMaxColumns];
    for (int c = 0; c < store_->n_columns(); ++c) columns[c] = store_->column(c);
    ssd_->write(swap_records_.data(), swap_keys_out_.data(), victims_.data(), k, columns, store_->n_columns(),
                store_->dim());
    for (size_t i = 0; i < k; ++i) {
      const int32_t s = victims_[i], r = swap_records_[i];
      ssd_meta(r);
      ssd_count_[r] = store_->counts()[s];
      ssd_ts_[r] = store_->last_seen()[s];
      ssd_uses_[r] = residency_.uses(s);
      map_.set_slot_at(map_.probe(swap_keys_out_[i]), loc_of_record(r));
      slot_key_[s] = kNoKey;
      free_.push_back(s);
    }
    tier_.swapped_out += k;
    tier_.step_out += k;
    tier_.bytes_out += k * static_cast<uint64_t>(ssd_->record_bytes());
  }

  // A free memory row (make_room made sure there is one).
  int32_t take_memory_row() {
    if (!free_.empty()) {
      const int32_t s = free_.back();
      free_.pop_back();
      return s;
    }
    if (next_slot_ >= capacity_) throw std::logic_error("table '" + name_ + "': no free memory row after make_room");
    store_->ensure_rows(static_cast<int64_t>(next_slot_) + 1);
    return next_slot_++;
  }

  int32_t take_tiered_slot(int64_t key) {
    make_room(1);
    const bool reuse = !free_.empty();
    const int32_t s = take_memory_row();
    if (reuse) ++counters_.reused;
    store_->reset_row_for_key(s, key);
    slot_key_[s] = key;
    residency_.arrive(s, 0);
    residency_.touch(s, channel_);
    return s;
  }

  void retire_oldest_step() {
    if (spare_.size() < 2) spare_.push_back(std::move(journal_.front()));
    journal_.pop_front();
  }

  static uint32_t saturated(uint64_t c) { return static_cast<uint32_t>(std::min<uint64_t>(c, UINT32_MAX)); }

  void add_pending(size_t bucket, int64_t key, uint64_t count, int64_t ts) {
    int32_t p;
    if (!pend_free_.empty()) {
      p = pend_free_.back();
      pend_free_.pop_back();
      pend_count_[p] = saturated(count);
      pend_ts_[p] = ts;
    } else {
      p = static_cast<int32_t>(pend_count_.size());
      pend_count_.push_back(saturated(count));
      pend_ts_.push_back(ts);
    }
    pending_.insert_at(bucket, key, p);
  }

  void forget_pending(int64_t key, int32_t p) {
    pending_.erase(key);
    pend_free_.push_back(p);
  }

  // A row for new key `key`.
  int32_t take_slot(int64_t key) {
    if (ssd_) return take_tiered_slot(key);
    if (!free_.empty()) {
      const int32_t s = free_.back();
      free_.pop_back();
      store_->reset_row(s);
      ++counters_.reused;
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
  int64_t access_ = -1, eviction_ = -1;
  int64_t newest_ = -1;
  KeySlotMap pending_;                 // key -> its place in pend_count_ / pend_ts_
  std::vector<uint32_t> pend_count_;
  std::vector<int64_t> pend_ts_;
  std::vector<int32_t> pend_free_;
  std::vector<std::pair<int64_t, int32_t>> quarantine_;  // (step of the eviction, location), in step order

  // The SSD tier (null: every row in memory) and, per memory row, the key it holds (kNoKey: free
  // or held back), its pins and coldness; per SSD record, the key's count, timestamp and uses.
  std::unique_ptr<SsdTier> ssd_;
  Residency residency_;
  std::vector<int64_t> slot_key_;
  std::vector<uint32_t> ssd_count_, ssd_uses_;
  std::vector<int64_t> ssd_ts_;
  int channel_ = 0;        // of the lookup in progress
  size_t batch_keys_ = 0;  // keys of the lookup in progress
  std::vector<int64_t> swap_keys_, swap_keys_out_;
  std::vector<int32_t> swap_records_, swap_rows_, victims_;
  TierCounters tier_;

  // What a step changed, to be undone by export_as_of: a key's state before the change.
  enum Was : uint8_t { kAbsent, kPending, kRow };
  struct Change {
    int64_t key;
    int64_t ts;
    uint32_t count;
    int32_t slot;  // kRow in an eviction: the row held back
    Was was;
  };
  struct StepJournal {
    int64_t step = 0;
    int64_t newest_before = -1;
    std::vector<Change> evicted, looked_up;
  };
  // Steps ahead of training a checkpoint can be taken back from: input pipelines prefetch a few
  // batches; a save further behind than this is not exact, and says so.
  static constexpr size_t kJournalSteps = 64;
  std::deque<StepJournal> journal_;
  std::vector<StepJournal> spare_;
  int64_t dropped_upto_ = INT64_MIN;
  IndexCounters counters_;
};

}  // namespace shardrec
