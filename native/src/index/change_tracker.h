// What changed in a table shard since its last save, for incremental checkpoints: a byte per row
// (row_store.h's `changed`, set by the optimizers' kernels and by a new key taking a row; an SSD
// record's own flag) and, once tracking is on, the keys removed since (evicted or erased) with the
// step of their removal; and whether the index was emptied (a restore, a warm start) since the
// last full save, which makes the next save a full one. Not locked: the index holds its lock
// around every call.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "index/index_state.h"
#include "index/key_row_map.h"
#include "index/located_rows.h"
#include "storage/memory_rows.h"
#include "storage/row_store.h"
#include "storage/ssd_rows.h"

namespace shardrec {

class ChangeTracker {
 public:
  ChangeTracker(RowStore* store, const KeyRowMap& map, const MemoryRows& rows, LocatedRows& located,
                const std::unique_ptr<SsdRows>& ssd, int32_t capacity)
      : store_(store), map_(map), rows_(rows), located_(located), ssd_(ssd), capacity_(capacity) {}

  bool on() const { return on_; }
  // From now on keys removed are remembered until a save takes them (off: nothing is kept). A
  // table in memory alone also keeps each row's key, so that its changed rows are found from the
  // rows' flags (for_each_changed).
  void set(bool on) {
    on_ = on;
    store_->set_tracking(on);
    if (!on) removed_.clear();
    if (on && !ssd_) map_.for_each([&](int64_t k, int32_t s) { store_->row_keys()[s] = k; });
  }

  // A new key took row `s`: the next delta holds it.
  void took_row(int64_t key, int32_t s) {
    store_->changed()[s] = 1;
    if (on_ && !ssd_) store_->row_keys()[s] = key;
  }
  // `key` was removed at training step `step` (INT64_MIN: before any step, the next save takes it).
  void removed(int64_t key, int64_t step) {
    if (on_) removed_.emplace_back(key, step);
  }
  // The index was emptied: no removal list holds what it dropped.
  void emptied() {
    removed_.clear();
    cleared_ = true;
  }
  bool cleared_since_full_save() const { return cleared_; }

  // Every row as saved (after a restore, the rows equal the checkpoint's; after a full save, the
  // next delta is relative to it).
  void forget(bool full_save) {
    std::memset(store_->changed(), 0, static_cast<size_t>(rows_.high()));
    if (ssd_) ssd_->clear_changed();
    if (full_save)
      cleared_ = false;
    else
      removed_.clear();
  }

  size_t changed_rows() const {
    size_t n = 0;
    for_each_changed([&](int64_t, int32_t) { ++n; });
    return n;
  }

  // f(key, location) for every key whose row changed since the last save. A tracked table in memory
  // alone: a pass over the rows' flags, each changed row's key from row_keys() (a freed row keeps
  // its flag and its old key: the key map says whether the key still lives there); 5M keys, 1% of
  // them changed: 1.5 ms instead of a pass over the key map (60-75 ms). Else that pass, each row's
  // flag prefetched a few buckets ahead.
  template <typename F>
  void for_each_changed(F&& f) const {
    const uint8_t* changed = store_->changed();
    if (on_ && !ssd_) {
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
      if (map_.occupied(b) && located_.changed(map_.row_at(b))) f(map_.key_at(b), map_.row_at(b));
    }
  }

  // Keeps the keys of `state` whose rows changed (their flags cleared: this save holds them).
  void keep_changed(IndexState& state) {
    const bool meta = state.counts.size() == state.keys.size() && !state.keys.empty();
    size_t kept = 0;
    for (size_t i = 0; i < state.keys.size(); ++i) {
      const int32_t loc = state.rows[i];
      if (!located_.changed(loc)) continue;
      located_.set_changed(loc, 0);
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

 private:
  RowStore* const store_;
  const KeyRowMap& map_;
  const MemoryRows& rows_;
  LocatedRows& located_;
  const std::unique_ptr<SsdRows>& ssd_;
  const int32_t capacity_;
  bool on_ = false;
  bool cleared_ = false;
  std::vector<std::pair<int64_t, int64_t>> removed_;  // (key, step of its removal) since the last save
};

}  // namespace shardrec
