// One table shard's key index: which row of the shard's row store holds each key, and the counters
// users see. It owns the lock, and the parts that it holds under it:
//   - the key map (key_row_map.h) and the memory rows, free and in use (memory_rows.h);
//   - with admission (access_threshold >= 0), the keys still counting towards a row
//     (counting_keys.h): a key gets a row once its count reaches the threshold;
//   - with eviction, the rows of keys whose last-seen timestamp is old enough are freed, each held
//     back until the training step has passed every batch that may still reference it
//     (release_evicted);
//   - the step journal (step_journal.h): the input pipeline looks batches up ahead of training, so
//     when a checkpoint is saved after step T the index has already counted (and admitted, and maybe
//     evicted for) batches T, T+1, ...; export_as_of(T) takes them back;
//   - with an SSD tier, the rows that live on SSD (ssd_rows.h) and, for every table, the tickets of
//     each channel's batches (residency.h);
//   - for incremental checkpoints, what changed since the last save: a byte per row (row_store.h's
//     `changed`, set by the optimizers' kernels and by a new key taking a row) and, once
//     track_changes() is on, the keys removed since (evicted or erased), with the step of removal.
// Thread-safe: the train and eval pipelines of a table run in different TensorFlow threads. A new
// row beyond the rows in use puts the next chunk of the store in use (dynamic expansion), on the
// pipeline's thread, before any kernel sees it.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "storage/array_file.h"
#include "exchange/channel.h"
#include "index/counting_keys.h"
#include "index/index_state.h"
#include "index/key_row_map.h"
#include "storage/memory_rows.h"
#include "storage/residency.h"
#include "storage/row_store.h"
#include "storage/ssd_rows.h"
#include "index/step_journal.h"

namespace shardrec {

class EmbeddingIndex {
 public:
  // `capacity`: the rows the shard may hold (the store's rows less the sentinel). The map is sized
  // for `expected` keys here, so that no batch stalls on a rehash (a rehash of a large map inside
  // one batch made inserting batches 5-10x slower than the median): the whole shard for a table
  // of fixed size; with dynamic expansion, the shard's initial size, and it doubles from there.
  EmbeddingIndex(std::string name, int64_t capacity, RowStore* store, int64_t expected, bool expands)
      : name_(std::move(name)),
        capacity_(checked_capacity(capacity)),
        store_(store),
        expands_(expands),
        rows_(store, capacity_),
        at_{capacity_} {
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
    return map_.memory_bytes() + rows_.memory_bytes() + counting_.memory_bytes() +
           quarantine_.capacity() * sizeof(quarantine_[0]) + (ssd_ ? ssd_->memory_bytes() : 0);
  }

  // ---- the SSD tier (ssd_rows.h): a key on SSD maps to location capacity() + 1 + its record.
  void set_ssd(int64_t records, std::vector<std::string> dirs, int rank, SwapPolicy policy) {
    std::lock_guard<std::mutex> g(mu_);
    if (map_.size() > 0 || rows_.high() > 0) throw std::logic_error("the SSD tier is set before the first key");
    if (records < 1 || static_cast<int64_t>(capacity_) + 1 + records >= INT32_MAX)
      throw std::invalid_argument("SSD rows must be in [1, 2^31 - 2 - memory rows], got " + std::to_string(records));
    ssd_ = std::make_unique<SsdRows>(name_, rank, std::move(dirs), records, policy, store_, map_, rows_, residency_);
  }
  bool tiered() const { return ssd_ != nullptr; }
  // Keys the shard may hold: its memory rows and its SSD rows.
  int64_t max_keys() const { return capacity_ + (ssd_ ? ssd_->max_records() : 0); }
  size_t rows_on_ssd() const {
    std::lock_guard<std::mutex> g(mu_);
    return ssd_ ? ssd_->in_use() : 0;
  }
  TierCounters tier_counters() const {
    std::lock_guard<std::mutex> g(mu_);
    return ssd_ ? ssd_->counters() : TierCounters{};
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

  // A new batch of `channel`, once per exchange round: its ticket, which the lookup's row gather
  // reports when it reads the batch's rows (residency.h).
  uint32_t begin_batch(Channel channel) {
    std::lock_guard<std::mutex> g(mu_);
    if (channel == Channel::kTrain && ssd_) ssd_->new_step();
    return residency_.begin_batch(channel);
  }

  // ---- lookups
  // Maps keys to rows. allocate=false (eval) never inserts: unknown keys get the sentinel.
  void lookup(const int64_t* keys, size_t n, bool allocate, int32_t* rows) {
    std::lock_guard<std::mutex> g(mu_);
    if (ssd_) ssd_->bring_in(keys, n, allocate ? Channel::kTrain : Channel::kEval, allocate);
    lookup_locked(keys, n, allocate, rows);
  }

  // A training lookup with admission: meta[2i] is how often keys[i] occurs in the batch (all
  // requesters together), meta[2i+1] its newest timestamp (0 without a timestamp feature). Keys
  // with a row are counted; a key without one is counted towards admission and gets a row once its
  // count reaches the threshold, else the sentinel (zeros, no update).
  void lookup_counted(const int64_t* keys, const int64_t* meta, size_t n, int32_t* rows) {
    std::lock_guard<std::mutex> g(mu_);
    if (ssd_) ssd_->bring_in(keys, n, Channel::kTrain, false);  // few new keys are admitted: room is made as they are
    find_rows(keys, n, rows);
    uint32_t* counts = store_->counts();
    int64_t* last_seen = store_->last_seen();
    std::vector<StepJournal::Change>* log = journal_.looked_up();
    constexpr size_t kAhead = 8;  // the rows' metadata (or the counting keys) prefetched ahead
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) {
        const int32_t ahead = rows[i + kAhead];
        if (ahead != KeyRowMap::kEmpty) {
          __builtin_prefetch(counts + ahead);
          __builtin_prefetch(last_seen + ahead);
        } else {
          counting_.prefetch(keys[i + kAhead]);
        }
      }
      const int64_t c = meta[2 * i], ts = meta[2 * i + 1];
      const int32_t s = rows[i];
      if (s == KeyRowMap::kEmpty) {
        rows[i] = count_towards_admission(keys[i], c, ts, log);
        continue;
      }
      if (log != nullptr) log->push_back({keys[i], last_seen[s], counts[s], s, StepJournal::Was::kRow});
      counts[s] = saturated(counts[s] + static_cast<uint64_t>(c));
      last_seen[s] = std::max(last_seen[s], ts);
    }
  }

  // ---- rows of any tier (checkpoints)
  // Restore: a location for each of `keys` (distinct, none held yet), memory first, then SSD, with
  // fresh rows (values drawn from the key, slots at their initial values) that write_rows fills.
  void place(const int64_t* keys, size_t n, int32_t* locs) {
    std::lock_guard<std::mutex> g(mu_);
    if (!ssd_) {
      lookup_locked(keys, n, true, locs);
      return;
    }
    for (size_t i = 0; i < n; ++i) {
      if (map_.occupied(map_.probe(keys[i])))
        throw std::invalid_argument("key " + std::to_string(keys[i]) + " is restored twice");
      locs[i] = rows_.available() > 0 ? take_row(keys[i]) : ssd_->place_on_ssd(keys[i]);
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
  void write_rows(int c, const int64_t* keys, const int32_t* locs, size_t n, const float* in) {
    std::lock_guard<std::mutex> g(mu_);
    const int64_t dim = store_->dim();
    for (size_t i = 0; i < n; ++i) {
      if (at_.on_ssd(locs[i]))
        ssd_->write_row(c, keys[i], locs[i], in + i * dim);
      else
        std::memcpy(store_->column(c) + static_cast<int64_t>(locs[i]) * dim, in + i * dim, dim * sizeof(float));
    }
  }

  // A checkpoint's view: every key (as of training step `step`, or as the index is when `as_of` is
  // false) with the rows of `columns`, taken under one hold of the lock, so that no lookup of the
  // input pipeline (which may move rows between tiers) comes between the keys and their rows.
  struct Snapshot {
    IndexState state;
    std::vector<std::vector<float>> columns;
  };
  Snapshot snapshot(bool as_of, int64_t step, const std::vector<int>& columns) const {
    std::lock_guard<std::mutex> g(mu_);
    Snapshot out;
    export_state_locked(as_of, step, out.state);
    const size_t n = out.state.keys.size();
    for (int c : columns) {
      out.columns.emplace_back(n * static_cast<size_t>(store_->dim()));
      read_rows_locked(c, out.state.keys.data(), out.state.rows.data(), n, out.columns.back().data());
    }
    return out;
  }

  // The same view written to disk instead: column columns[j] to paths[j] as an .npy file
  // (array_file.h), `chunk_rows` rows at a time, so that the rows of every tier pass through one
  // chunk of memory. The keys and admission state come back for the caller to write.
  struct SavedColumns {
    IndexState state;
    std::vector<FileDigest> files;
  };
  // kPlain: the index as it is, nothing else changes. kFull: the same, and what changed since is
  // forgotten (the next delta is relative to this save). kDelta: only the keys whose rows changed
  // since the previous save, their flags cleared, and state.removed the keys removed before `step`.
  // A save that fails on any rank is followed by a full one (rank_runtime/checkpoint/saver.py), so nothing
  // taken here is ever put back.
  enum class SaveMode : int { kPlain = 0, kFull = 1, kDelta = 2 };
  SavedColumns save_columns(bool as_of, int64_t step, const std::vector<int>& columns,
                            const std::vector<std::string>& paths, size_t chunk_rows, SaveMode mode) {
    std::lock_guard<std::mutex> g(mu_);
    SavedColumns out;
    const bool delta = mode == SaveMode::kDelta;
    export_state_locked(as_of, step, out.state, delta);
    if (delta) keep_changed(out.state);
    if (mode != SaveMode::kPlain) take_removed(as_of ? step : INT64_MAX, out.state.removed);
    if (mode == SaveMode::kFull) {
      clear_changed_locked();
      cleared_ = false;
    }
    const size_t n = out.state.keys.size(), dim = static_cast<size_t>(store_->dim());
    chunk_rows = std::max<size_t>(1, std::min(chunk_rows, n));
    std::vector<float> chunk(chunk_rows * dim);
    const std::string header = npy_header("<f4", {static_cast<int64_t>(n), static_cast<int64_t>(dim)});
    for (size_t j = 0; j < columns.size(); ++j) {
      ArrayFileWriter file(paths.at(j), header);
      for (size_t b = 0; b < n; b += chunk_rows) {
        const size_t m = std::min(chunk_rows, n - b);
        read_rows_locked(columns[j], out.state.keys.data() + b, out.state.rows.data() + b, m, chunk.data());
        file.write(chunk.data(), m * dim * sizeof(float));
      }
      out.files.push_back(file.finish());
    }
    return out;
  }

  // ---- incremental checkpoints
  // From now on keys removed are remembered until a save takes them (off: nothing is kept).
  void track_changes(bool on) {
    std::lock_guard<std::mutex> g(mu_);
    tracking_ = on;
    store_->set_tracking(on);
    if (!on) removed_.clear();
    if (on && !ssd_) map_.for_each([&](int64_t k, int32_t s) { store_->row_keys()[s] = k; });
  }
  // Every row as saved: after a restore, the rows equal the checkpoint's.
  void clear_changes() {
    std::lock_guard<std::mutex> g(mu_);
    clear_changed_locked();
    removed_.clear();
  }
  // Whether clear() emptied the index since the last full save (a restore, a warm start): the keys
  // it dropped are in no removal list, so the next save must be a full one.
  bool cleared_since_full_save() const {
    std::lock_guard<std::mutex> g(mu_);
    return cleared_;
  }
  size_t changed_rows() const {
    std::lock_guard<std::mutex> g(mu_);
    size_t n = 0;
    for_each_changed([&](int64_t, int32_t) { ++n; });
    return n;
  }

  // ---- admission and eviction, set before the first batch. access < 0: every key gets a row at
  // once and nothing is counted; eviction < 0: nothing is evicted.
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
    return counting_.size();
  }
  size_t held_back() const {
    std::lock_guard<std::mutex> g(mu_);
    return quarantine_.size();
  }

  // The exchange starts a step's journal before the step's eviction and lookups.
  void begin_step(int64_t step) {
    std::lock_guard<std::mutex> g(mu_);
    journal_.begin(step, newest_);
  }

  // Evicts every key (with a row or still counting) whose last-seen timestamp is at least the
  // eviction threshold older than the newest one. Freed rows are held back, tagged with `step`
  // (the training steps whose batches were looked up before this eviction): release_evicted frees
  // them once training has passed that step. Returns the number of keys with a row evicted.
  size_t evict(int64_t step) {
    std::lock_guard<std::mutex> g(mu_);
    if (eviction_ < 0 || newest_ < 0) return 0;
    const int64_t cutoff = newest_ - eviction_;
    std::vector<int64_t> old = keys_seen_before(cutoff);
    std::vector<StepJournal::Change>* log = journal_.evicted();
    for (size_t i = 0; i < old.size(); ++i) {
      if (i + 8 < old.size()) map_.prefetch(old[i + 8]);
      const int64_t k = old[i];
      const int32_t s = map_.erase(k);
      if (log != nullptr) log->push_back({k, ts_at(s), count_at(s), s, StepJournal::Was::kRow});
      if (ssd_ && !at_.on_ssd(s)) ssd_->forget(s);
      quarantine_.emplace_back(step, s);
      if (tracking_) removed_.emplace_back(k, step);
    }
    counters_.evicted += old.size();
    const size_t rows = old.size();
    old.clear();
    counting_.for_each([&](int64_t k, int32_t p) {
      if (counting_.last_seen(p) <= cutoff) old.push_back(k);
    });
    for (int64_t k : old) {
      const int32_t p = counting_.at(k);
      if (log != nullptr) log->push_back({k, counting_.last_seen(p), counting_.count(p), -1, StepJournal::Was::kPending});
      counting_.forget(k, p);
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
    journal_.retire_before(trained_step);
    size_t n = 0;
    for (; n < quarantine_.size() && quarantine_[n].first < trained_step; ++n) free_location(quarantine_[n].second);
    quarantine_.erase(quarantine_.begin(), quarantine_.begin() + static_cast<std::ptrdiff_t>(n));
    return n;
  }

  // Counts and last-seen timestamps of `rows` (a checkpoint's rows) / set from one.
  void read_metadata(const int32_t* rows, size_t n, uint32_t* counts, int64_t* last_seen) const {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < n; ++i) {
      counts[i] = count_at(rows[i]);
      last_seen[i] = ts_at(rows[i]);
    }
  }
  void write_metadata(const int32_t* rows, size_t n, const uint32_t* counts, const int64_t* last_seen) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < n; ++i) {
      count_at(rows[i]) = counts[i];
      ts_at(rows[i]) = last_seen[i];
    }
  }

  // Every key as of step `step`: the current keys with the journal of steps >= step undone. Rows
  // of keys admitted since have no place in it; rows evicted since are held back, their values
  // those of step `step`.
  IndexState export_as_of(int64_t step) const {
    std::lock_guard<std::mutex> g(mu_);
    return export_as_of_locked(step);
  }
  // Every (key, row) pair, in row order so exports are reproducible.
  void export_pairs(std::vector<int64_t>& keys, std::vector<int32_t>& rows) const {
    std::lock_guard<std::mutex> g(mu_);
    export_pairs_locked(keys, rows);
  }
  PendingKeys export_pending() const {
    std::lock_guard<std::mutex> g(mu_);
    return counting_.export_all();
  }
  // Keys still counting, from a checkpoint; a key that has a row is refused.
  void import_pending(const int64_t* keys, const uint32_t* counts, const int64_t* last_seen, size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < n; ++i) {
      if (map_.find(keys[i]) != KeyRowMap::kEmpty)
        throw std::invalid_argument("key " + std::to_string(keys[i]) + " is both admitted and pending");
      counting_.set(keys[i], counts[i], last_seen[i]);
    }
  }

  // Keys this shard sent to owners and received from requesters in one exchange.
  void add_traffic(uint64_t sent, uint64_t received) {
    std::lock_guard<std::mutex> g(mu_);
    counters_.keys_sent += sent;
    counters_.keys_received += received;
  }

  // Frees the rows of `keys`; their rows are reused by later inserts. Returns how many existed.
  size_t erase(const int64_t* keys, size_t n) {
    std::lock_guard<std::mutex> g(mu_);
    size_t removed = 0;
    for (size_t i = 0; i < n; ++i) {
      const int32_t row = map_.erase(keys[i]);
      if (row == KeyRowMap::kEmpty) continue;
      free_location(row);
      if (tracking_) removed_.emplace_back(keys[i], INT64_MIN);  // before any step: the next save takes it
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
    rows_.clear();
    counting_.clear();
    quarantine_.clear();
    journal_.clear();
    removed_.clear();
    cleared_ = true;
    newest_ = -1;
    if (ssd_) ssd_->clear();
  }

 private:
  static int32_t checked_capacity(int64_t capacity) {
    if (capacity < 1 || capacity >= INT32_MAX)
      throw std::invalid_argument("capacity must be in [1, 2^31-2], got " + std::to_string(capacity));
    return static_cast<int32_t>(capacity);
  }

  // The row of each key (kEmpty: none), prefetching the map's buckets a few keys ahead. Every row
  // found is in memory (bring_in came first).
  void find_rows(const int64_t* keys, size_t n, int32_t* rows) const {
    constexpr size_t kAhead = 8;
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) map_.prefetch(keys[i + kAhead]);
      const size_t b = map_.probe(keys[i]);
      rows[i] = map_.occupied(b) ? map_.row_at(b) : KeyRowMap::kEmpty;
      if (rows[i] != KeyRowMap::kEmpty && at_.on_ssd(rows[i]))
        throw std::logic_error("table '" + name_ + "': a row of this batch is not in memory");
    }
  }

  // A training occurrence of `key`, which has no row: it counts towards admission and gets a row
  // once its count reaches the threshold. Returns its row, or the sentinel.
  int32_t count_towards_admission(int64_t key, int64_t occurrences, int64_t ts,
                                   std::vector<StepJournal::Change>* log) {
    const CountingKeys::Found f = counting_.find(key);
    const bool known = f.at != CountingKeys::kNone;
    const uint64_t total = static_cast<uint64_t>(occurrences) + (known ? counting_.count(f.at) : 0);
    const int64_t seen = std::max(ts, known ? counting_.last_seen(f.at) : INT64_MIN);
    if (log != nullptr)
      log->push_back(known ? StepJournal::Change{key, counting_.last_seen(f.at), counting_.count(f.at), -1,
                                                 StepJournal::Was::kPending}
                           : StepJournal::Change{key, 0, 0, -1, StepJournal::Was::kAbsent});
    if (static_cast<int64_t>(total) >= access_) {
      const int32_t row = take_row(key);
      map_.insert_at(map_.probe(key), key, row);
      store_->counts()[row] = saturated(total);
      store_->last_seen()[row] = seen;
      if (known) counting_.forget(key, f.at);
      ++counters_.inserted;
      ++counters_.admitted;
      return row;
    }
    if (known) {
      counting_.count(f.at) = saturated(total);
      counting_.last_seen(f.at) = seen;
    } else {
      counting_.add(f.bucket, key, total, seen);
    }
    counters_.rejected += static_cast<uint64_t>(occurrences);
    return sentinel();
  }

  // The keys with a row whose last-seen timestamp is <= cutoff: a scan of every bucket, each held
  // key's timestamp a random access into the store's metadata, prefetched a few buckets ahead.
  std::vector<int64_t> keys_seen_before(int64_t cutoff) const {
    const int64_t* last_seen = store_->last_seen();
    std::vector<int64_t> old;
    constexpr size_t kAhead = 16;
    const size_t buckets = map_.bucket_count();
    for (size_t b = 0; b < buckets; ++b) {
      if (b + kAhead < buckets && map_.occupied(b + kAhead) && map_.row_at(b + kAhead) < capacity_)
        __builtin_prefetch(last_seen + map_.row_at(b + kAhead));
      if (map_.occupied(b) && ts_at(map_.row_at(b)) <= cutoff) old.push_back(map_.key_at(b));
    }
    return old;
  }

  void read_rows_locked(int c, const int64_t* keys, const int32_t* locs, size_t n, float* out) const {
    if (!ssd_) {
      store_->read_rows(c, locs, static_cast<int64_t>(n), out);
      return;
    }
    const int64_t dim = store_->dim();
    for (size_t i = 0; i < n; ++i) {
      if (at_.on_ssd(locs[i]))
        ssd_->read_row(c, keys[i], locs[i], out + i * dim);
      else
        std::memcpy(out + i * dim, store_->column(c) + static_cast<int64_t>(locs[i]) * dim, dim * sizeof(float));
    }
  }

  // only_changed: the keys whose rows changed since the last save alone (a delta), and those that
  // the journal brings back; the journal's undo needs no other key.
  IndexState export_as_of_locked(int64_t step, bool only_changed = false) const {
    KeyStates rows, pending;
    rows.reserve(only_changed ? 1024 : map_.size());
    auto keep = [&](int64_t k, int32_t s) { rows[k] = KeyState{s, count_at(s), ts_at(s)}; };
    if (only_changed)
      for_each_changed(keep);
    else
      map_.for_each(keep);
    counting_.for_each([&](int64_t k, int32_t p) { pending[k] = KeyState{-1, counting_.count(p), counting_.last_seen(p)}; });
    IndexState out;
    out.exact = journal_.reaches(step);
    out.newest = journal_.undo(step, rows, pending, newest_, only_changed);
    std::vector<std::pair<int32_t, int64_t>> order;
    order.reserve(rows.size());
    for (const auto& [k, e] : rows) order.emplace_back(e.row, k);
    std::sort(order.begin(), order.end());
    for (const auto& [s, k] : order) {
      const KeyState& e = rows[k];
      out.keys.push_back(k);
      out.rows.push_back(s);
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

  // Every key and its location, as of training step `step` (with the admission state) or as the
  // index is now (as_of false: keys and locations alone).
  void export_state_locked(bool as_of, int64_t step, IndexState& state, bool only_changed = false) const {
    if (as_of)
      state = export_as_of_locked(step, only_changed);
    else if (only_changed)
      export_changed_pairs_locked(state.keys, state.rows);
    else
      export_pairs_locked(state.keys, state.rows);
  }

  // The (key, location) pairs whose rows changed since the last save, in location order: one pass
  // over the map's buckets, which a delta of a large table costs instead of exporting every key.
  void export_changed_pairs_locked(std::vector<int64_t>& keys, std::vector<int32_t>& rows) const {
    std::vector<std::pair<int32_t, int64_t>> pairs;
    for_each_changed([&](int64_t k, int32_t s) { pairs.emplace_back(s, k); });
    std::sort(pairs.begin(), pairs.end());
    keys.clear();
    rows.clear();
    keys.reserve(pairs.size());
    rows.reserve(pairs.size());
    for (const auto& [s, k] : pairs) {
      keys.push_back(k);
      rows.push_back(s);
    }
  }

  void export_pairs_locked(std::vector<int64_t>& keys, std::vector<int32_t>& rows) const {
    keys.clear();
    rows.clear();
    keys.reserve(map_.size());
    rows.reserve(map_.size());
    if (!ssd_) {  // memory rows alone: placed by row, no sort
      const int32_t high = rows_.high();
      std::vector<int64_t> by_row(high);
      std::vector<char> used(high, 0);
      map_.for_each([&](int64_t k, int32_t s) {
        by_row[s] = k;
        used[s] = 1;
      });
      for (int32_t s = 0; s < high; ++s) {
        if (!used[s]) continue;
        keys.push_back(by_row[s]);
        rows.push_back(s);
      }
      return;
    }
    std::vector<std::pair<int32_t, int64_t>> pairs;
    pairs.reserve(map_.size());
    map_.for_each([&](int64_t k, int32_t s) { pairs.emplace_back(s, k); });
    std::sort(pairs.begin(), pairs.end());
    for (const auto& [s, k] : pairs) {
      keys.push_back(k);
      rows.push_back(s);
    }
  }

  void lookup_locked(const int64_t* keys, size_t n, bool allocate, int32_t* rows) {
    for (size_t i = 0; i < n; ++i) {
      const size_t b = map_.probe(keys[i]);
      if (map_.occupied(b)) {
        rows[i] = map_.row_at(b);
        if (at_.on_ssd(rows[i])) throw std::logic_error("table '" + name_ + "': a row of this batch is not in memory");
      } else if (!allocate) {
        rows[i] = sentinel();
        ++counters_.missed;
      } else {
        const int32_t row = take_row(keys[i]);
        map_.insert_at(b, keys[i], row);  // moving rows down (take_row) changes rows, not buckets
        rows[i] = row;
        ++counters_.inserted;
      }
    }
  }

  // A row for new key `key`: with an SSD tier, a memory row (room made); else a freed row (its
  // values reset) or the next one.
  int32_t take_row(int64_t key) {
    const int32_t s = take_fresh_row(key);
    store_->changed()[s] = 1;  // a new key's row: the next delta holds it
    if (tracking_ && !ssd_) store_->row_keys()[s] = key;
    return s;
  }
  int32_t take_fresh_row(int64_t key) {
    if (ssd_) return ssd_->take_row(key, counters_.reused);
    const bool reuse = rows_.reusing();
    const int32_t s = rows_.take();
    if (s < 0)
      throw CapacityError("table '" + name_ + "': the device tier is full (" + std::to_string(capacity_) +
                          " rows on this rank); raise the table's device_vocabulary_size" +
                          (expands_ ? " or SHARDREC_TABLE_MEMORY_LIMIT" : ", or init(use_dynamic_expansion=True)"));
    if (reuse) {
      store_->reset_row(s);
      ++counters_.reused;
    }
    return s;
  }

  void free_location(int32_t loc) {
    if (ssd_) ssd_->forget(loc);
    if (!at_.on_ssd(loc)) rows_.release(loc);
  }

  uint8_t changed_at(int32_t loc) const { return at_.on_ssd(loc) ? ssd_->changed(loc) : store_->changed()[loc]; }

  // f(key, location) for every key whose row changed since the last save. A tracked table in memory
  // alone: a pass over the rows' flags, each changed row's key from row_keys() (a freed row keeps
  // its flag and its old key: the key map says whether the key still lives there); 5M keys, 1% of
  // them changed: 1.5 ms instead of a pass over the key map (60-75 ms). Else that pass, each row's
  // flag prefetched a few buckets ahead.
  template <typename F>
  void for_each_changed(F&& f) const {
    const uint8_t* changed = store_->changed();
    if (tracking_ && !ssd_) {
      const int64_t* keys = store_->row_keys();
      const int32_t high = rows_.high();
      for (int32_t s = 0; s < high; ++s) {
        if (changed[s] && map_.find(keys[s]) == s) f(keys[s], s);
      }
      return;
    }
    constexpr size_t kAhead = 16;
    const size_t buckets = map_.bucket_count();
    for (size_t b = 0; b < buckets; ++b) {
      if (b + kAhead < buckets && map_.occupied(b + kAhead) && map_.row_at(b + kAhead) < capacity_)
        __builtin_prefetch(changed + map_.row_at(b + kAhead));
      if (map_.occupied(b) && changed_at(map_.row_at(b))) f(map_.key_at(b), map_.row_at(b));
    }
  }

  // Keeps the keys of `state` whose rows changed (their flags cleared: this save holds them).
  void keep_changed(IndexState& state) {
    const bool meta = state.counts.size() == state.keys.size() && !state.keys.empty();
    size_t kept = 0;
    for (size_t i = 0; i < state.keys.size(); ++i) {
      const int32_t loc = state.rows[i];
      if (!changed_at(loc)) continue;
      if (at_.on_ssd(loc))
        ssd_->changed(loc) = 0;
      else
        store_->changed()[loc] = 0;
      state.keys[kept] = state.keys[i];
      state.rows[kept] = loc;
      if (meta) {
        state.counts[kept] = state.counts[i];
        state.last_seen[kept] = state.last_seen[i];
      }
      ++kept;
    }
    state.keys.resize(kept);
    state.rows.resize(kept);
    if (meta) {
      state.counts.resize(kept);
      state.last_seen.resize(kept);
    }
  }

  // The keys removed before step `before` (a removal at a later step, by a batch looked up ahead of
  // training, is undone by the save's as-of view and belongs to the next save).
  void take_removed(int64_t before, std::vector<int64_t>& out) {
    size_t kept = 0;
    for (const auto& [key, step] : removed_) {
      if (step < before)
        out.push_back(key);
      else
        removed_[kept++] = {key, step};
    }
    removed_.resize(kept);
  }

  void clear_changed_locked() {
    std::memset(store_->changed(), 0, static_cast<size_t>(rows_.high()));
    if (ssd_) ssd_->clear_changed();
  }

  uint32_t& count_at(int32_t loc) { return at_.on_ssd(loc) ? ssd_->count(loc) : store_->counts()[loc]; }
  int64_t& ts_at(int32_t loc) { return at_.on_ssd(loc) ? ssd_->last_seen(loc) : store_->last_seen()[loc]; }
  uint32_t count_at(int32_t loc) const { return at_.on_ssd(loc) ? ssd_->count(loc) : store_->counts()[loc]; }
  int64_t ts_at(int32_t loc) const { return at_.on_ssd(loc) ? ssd_->last_seen(loc) : store_->last_seen()[loc]; }

  const std::string name_;
  const int32_t capacity_;
  RowStore* const store_;
  const bool expands_;
  mutable std::mutex mu_;
  KeyRowMap map_;
  MemoryRows rows_;
  const Locations at_;
  int64_t access_ = -1, eviction_ = -1;
  int64_t newest_ = -1;
  CountingKeys counting_;
  std::vector<std::pair<int64_t, int32_t>> quarantine_;  // (step of the eviction, location), in step order
  StepJournal journal_;
  bool tracking_ = false;
  bool cleared_ = false;
  std::vector<std::pair<int64_t, int64_t>> removed_;  // (key, step of its removal) since the last save
  Residency residency_;
  std::unique_ptr<SsdRows> ssd_;  // null: every row in memory
  IndexCounters counters_;
};

}  // namespace shardrec
