// A table shard's keys as a checkpoint sees them: every key with its location (and, as of a
// training step, its admission state with the step journal's look-ahead undone), or only those
// whose rows changed since the last save; and the rows of those keys written to array files a chunk
// at a time, whichever tier holds them. Not locked: the index holds its lock around every call, so
// that no lookup of the input pipeline comes between the keys and their rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "index/change_tracker.h"
#include "index/counting_keys.h"
#include "index/index_state.h"
#include "index/key_row_map.h"
#include "index/located_rows.h"
#include "index/step_journal.h"
#include "storage/array_file.h"
#include "storage/memory_rows.h"
#include "storage/ssd_rows.h"

namespace shardrec {

class IndexExport {
 public:
  IndexExport(const KeyRowMap& map, const MemoryRows& rows, const CountingKeys& counting, const StepJournal& journal,
              const LocatedRows& located, const ChangeTracker& changes, const std::unique_ptr<SsdRows>& ssd)
      : map_(map), rows_(rows), counting_(counting), journal_(journal), located_(located), changes_(changes),
        ssd_(ssd) {}

  // Every key and its location, as of training step `step` (with the admission state; newest: the
  // newest timestamp now) or as the index is now (as_of false: keys and locations alone).
  // only_changed: the keys whose rows changed since the last save alone (a delta).
  void state(bool as_of, int64_t step, int64_t newest, IndexState& out, bool only_changed = false) const {
    if (as_of)
      out = as_of_step(step, newest, only_changed);
    else if (only_changed)
      changed_pairs(out.keys, out.rows);
    else
      pairs(out.keys, out.rows);
  }

  // Every key as of step `step`: the current keys with the journal of steps >= step undone. Rows
  // of keys admitted since have no place in it; rows evicted since are held back, their values
  // those of step `step`. only_changed: the changed keys and those the journal brings back; the
  // journal's undo needs no other key.
  IndexState as_of_step(int64_t step, int64_t newest, bool only_changed = false) const {
    KeyStates rows, pending;
    rows.reserve(only_changed ? 1024 : map_.size());
    auto keep = [&](int64_t k, int32_t s) { rows[k] = KeyState{s, located_.count(s), located_.ts(s)}; };
    if (only_changed)
      changes_.for_each_changed(keep);
    else
      map_.for_each(keep);
    counting_.for_each([&](int64_t k, int32_t p) { pending[k] = KeyState{-1, counting_.count(p), counting_.last_seen(p)}; });
    IndexState out;
    out.exact = journal_.reaches(step);
    out.newest = journal_.undo(step, rows, pending, newest, only_changed);
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

  // Every (key, row) pair, in location order so exports are reproducible.
  void pairs(std::vector<int64_t>& keys, std::vector<int32_t>& rows) const {
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
    std::vector<std::pair<int32_t, int64_t>> sorted;
    sorted.reserve(map_.size());
    map_.for_each([&](int64_t k, int32_t s) { sorted.emplace_back(s, k); });
    in_location_order(sorted, keys, rows);
  }

  // The (key, location) pairs whose rows changed since the last save, in location order: one pass
  // over the map's buckets, which a delta of a large table costs instead of exporting every key.
  void changed_pairs(std::vector<int64_t>& keys, std::vector<int32_t>& rows) const {
    std::vector<std::pair<int32_t, int64_t>> sorted;
    changes_.for_each_changed([&](int64_t k, int32_t s) { sorted.emplace_back(s, k); });
    keys.clear();
    rows.clear();
    in_location_order(sorted, keys, rows);
  }

  // Column columns[j] of the rows of `state` to paths[j] as an .npy file (array_file.h),
  // `chunk_rows` rows at a time, so that the rows of every tier pass through one chunk of memory.
  std::vector<FileDigest> write_columns(const IndexState& state, int64_t dim, const std::vector<int>& columns,
                                        const std::vector<std::string>& paths, size_t chunk_rows) const {
    const size_t n = state.keys.size(), width = static_cast<size_t>(dim);
    chunk_rows = std::max<size_t>(1, std::min(chunk_rows, n));
    std::vector<float> chunk(chunk_rows * width);
    std::vector<uint16_t> narrow(chunk_rows * width);
    std::vector<FileDigest> files;
    for (size_t j = 0; j < columns.size(); ++j) {
      // As the column holds them: a 16-bit column's rows go back to 16 bits exactly.
      const RowFormat format = located_.format(columns[j]);
      ArrayFileWriter file(paths.at(j), npy_header(npy_descr(format), {static_cast<int64_t>(n), dim}));
      for (size_t b = 0; b < n; b += chunk_rows) {
        const size_t m = std::min(chunk_rows, n - b);
        located_.read(columns[j], state.keys.data() + b, state.rows.data() + b, m, chunk.data());
        if (format == RowFormat::kFloat32) {
          file.write(chunk.data(), m * width * sizeof(float));
        } else {
          narrow_nearest(chunk.data(), m * width, format, narrow.data());
          file.write(narrow.data(), m * width * sizeof(uint16_t));
        }
      }
      files.push_back(file.finish());
    }
    return files;
  }

 private:
  static void in_location_order(std::vector<std::pair<int32_t, int64_t>>& pairs, std::vector<int64_t>& keys,
                                std::vector<int32_t>& rows) {
    std::sort(pairs.begin(), pairs.end());
    keys.reserve(pairs.size());
    rows.reserve(pairs.size());
    for (const auto& [s, k] : pairs) {
      keys.push_back(k);
      rows.push_back(s);
    }
  }

  const KeyRowMap& map_;
  const MemoryRows& rows_;
  const CountingKeys& counting_;
  const StepJournal& journal_;
  const LocatedRows& located_;
  const ChangeTracker& changes_;
  const std::unique_ptr<SsdRows>& ssd_;
};

}  // namespace shardrec
