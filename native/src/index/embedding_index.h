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
//   - for incremental checkpoints, what changed since the last save (change_tracker.h);
//   - a checkpoint's view of the keys and their rows (index_export.h), through the rows of either
//     tier (located_rows.h).
// The index holds the lock and the order of operations; the parts hold the work.
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

#include "exchange/channel.h"
#include "index/change_tracker.h"
#include "index/counting_keys.h"
#include "index/index_export.h"
#include "index/index_state.h"
#include "index/key_row_map.h"
#include "index/located_rows.h"
#include "index/step_journal.h"
#include "storage/array_file.h"
#include "storage/memory_rows.h"
#include "storage/residency.h"
#include "storage/row_store.h"
#include "storage/ssd_rows.h"

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
    located_.read(c, keys, locs, n, out);
  }
  void write_rows(int c, const int64_t* keys, const int32_t* locs, size_t n, const float* in) {
    std::lock_guard<std::mutex> g(mu_);
    located_.write(c, keys, locs, n, in);
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
    export_.state(as_of, step, newest_, out.state);
    const size_t n = out.state.keys.size();
    for (int c : columns) {
      out.columns.emplace_back(n * static_cast<size_t>(store_->dim()));
      located_.read(c, out.state.keys.data(), out.state.rows.data(), n, out.columns.back().data());
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
  // keep_world > 1: only the keys with key mod keep_world == keep_rank (a replica's share).
  SavedColumns save_columns(bool as_of, int64_t step, const std::vector<int>& columns,
                            const std::vector<std::string>& paths, size_t chunk_rows, SaveMode mode,
                            int keep_world = 1, int keep_rank = 0) {
    std::lock_guard<std::mutex> g(mu_);
    SavedColumns out;
    const bool delta = mode == SaveMode::kDelta;
    export_.state(as_of, step, newest_, out.state, delta);
    if (delta) changes_.keep_changed(out.state);
    if (mode != SaveMode::kPlain) changes_.take_removed(as_of ? step : INT64_MAX, out.state.removed);
    out.state.keep_owned(keep_world, keep_rank);
    if (mode == SaveMode::kFull) changes_.forget(true);
    out.files = export_.write_columns(out.state, store_->dim(), columns, paths, chunk_rows);
    return out;
  }

  // ---- incremental checkpoints
  // From now on keys removed are remembered until a save takes them (off: nothing is kept).
  void track_changes(bool on) {
    std::lock_guard<std::mutex> g(mu_);
    changes_.set(on);
  }
  // Every row as saved: after a restore, the rows equal the checkpoint's.
  void clear_changes() {
    std::lock_guard<std::mutex> g(mu_);
    changes_.forget(false);
  }
  // Whether clear() emptied the index since the last full save (a restore, a warm start): the keys
  // it dropped are in no removal list, so the next save must be a full one.
  bool cleared_since_full_save() const {
    std::lock_guard<std::mutex> g(mu_);
    return changes_.cleared_since_full_save();
  }
  size_t changed_rows() const {
    std::lock_guard<std::mutex> g(mu_);
    return changes_.changed_rows();
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
      if (log != nullptr) log->push_back({k, located_.ts(s), located_.count(s), s, StepJournal::Was::kRow});
      if (ssd_ && !at_.on_ssd(s)) ssd_->forget(s);
      quarantine_.emplace_back(step, s);
      changes_.removed(k, step);
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
      counts[i] = located_.count(rows[i]);
      last_seen[i] = located_.ts(rows[i]);
    }
  }
  void write_metadata(const int32_t* rows, size_t n, const uint32_t* counts, const int64_t* last_seen) {
    std::lock_guard<std::mutex> g(mu_);
    for (size_t i = 0; i < n; ++i) {
      located_.count(rows[i]) = counts[i];
      located_.ts(rows[i]) = last_seen[i];
    }
  }

  // Every key as of step `step`: the current keys with the journal of steps >= step undone. Rows
  // of keys admitted since have no place in it; rows evicted since are held back, their values
  // those of step `step`.
  IndexState export_as_of(int64_t step) const {
    std::lock_guard<std::mutex> g(mu_);
    return export_.as_of_step(step, newest_);
  }
  // Every (key, row) pair, in row order so exports are reproducible.
  void export_pairs(std::vector<int64_t>& keys, std::vector<int32_t>& rows) const {
    std::lock_guard<std::mutex> g(mu_);
    export_.pairs(keys, rows);
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
      changes_.removed(keys[i], INT64_MIN);
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
    changes_.emptied();
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
      if (map_.occupied(b) && located_.ts(map_.row_at(b)) <= cutoff) old.push_back(map_.key_at(b));
    }
    return old;
  }

  void lookup_locked(const int64_t* keys, size_t n, bool allocate, int32_t* rows) {
    // A batch's keys are spread over a map of millions of buckets: each probe is a cache miss
    // unless asked for ahead (bench/limit.py, SGD dim 16 on one core, with owners_of: 71.5, 73.4,
    // 64.7 -> 61.6, 60.7, 58.5 ns of CPU per id, alternating).
    constexpr size_t kAhead = 16;
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) map_.prefetch(keys[i + kAhead]);
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
    changes_.took_row(key, s);
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
  Residency residency_;
  std::unique_ptr<SsdRows> ssd_;  // null: every row in memory
  // Composed over the parts above (declared after them: they hold references to them).
  LocatedRows located_{store_, at_, ssd_};
  ChangeTracker changes_{store_, map_, rows_, located_, ssd_, capacity_};
  IndexExport export_{map_, rows_, counting_, journal_, located_, changes_, ssd_};
  IndexCounters counters_;
};

}  // namespace shardrec
