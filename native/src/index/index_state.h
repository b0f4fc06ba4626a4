// The values an index hands out: its counters and its keys as a checkpoint sees them. The counter
// fields are listed once, as X-macros, so that the struct, its Python class (module.cpp, read-only
// fields) and its dict for JSON cannot disagree.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace shardrec {

#define SHARDREC_INDEX_COUNTERS(X)                                                               \
  X(uint64_t, keys_sent, "unique batch keys sent to their owners (own rank included)")           \
  X(uint64_t, keys_received, "keys received as their owner (own rank included)")                 \
  X(uint64_t, inserted, "keys given a new row")                                                  \
  X(uint64_t, missed, "unknown keys on a non-allocating (eval) lookup")                          \
  X(uint64_t, erased, "keys erased")                                                             \
  X(uint64_t, admitted, "keys given a row because their count reached the threshold")            \
  X(uint64_t, rejected, "training occurrences of keys that had no row yet (zeros, no update)")   \
  X(uint64_t, evicted, "keys whose row eviction freed")                                          \
  X(uint64_t, evicted_pending, "keys still counting towards admission that eviction forgot")     \
  X(uint64_t, reused, "freed rows taken again (fresh initial values)")

// A table with an SSD tier: where its keys were found and what moved.
#define SHARDREC_TIER_COUNTERS(X)                                                                \
  X(uint64_t, memory_hits, "keys looked up whose row was in memory")                             \
  X(uint64_t, ssd_hits, "keys looked up whose row was on SSD (and was swapped in)")              \
  X(uint64_t, misses, "keys looked up that had no row (new, pending or unknown)")                \
  X(uint64_t, swapped_in, "rows moved from SSD to memory")                                       \
  X(uint64_t, swapped_out, "rows moved from memory to SSD")                                      \
  X(uint64_t, bytes_swapped_in, "bytes read from SSD by swaps")                                  \
  X(uint64_t, bytes_swapped_out, "bytes written to SSD by swaps")                                \
  X(uint64_t, swapped_in_last_step, "rows swapped in since the last training batch began")       \
  X(uint64_t, swapped_out_last_step, "rows swapped out since the last training batch began")

#define SHARDREC_EXCHANGE_COUNTERS(X)                                                            \
  X(uint64_t, batches, "batches exchanged")                                                      \
  X(uint64_t, evictions, "eviction rounds")                                                      \
  X(int64_t, last_eviction_step, "the training step of the last eviction (-1: none)")            \
  X(uint64_t, ns_in_collectives, "nanoseconds spent waiting in MPI, all rounds together")        \
  X(uint64_t, ns_total, "nanoseconds spent in the exchange, all rounds together")                \
  X(uint64_t, ns_cpu, "CPU nanoseconds the exchange's thread used in it (its own work, not its waits)")          \
  X(uint64_t, pool_bytes_sent, "bytes of pooled features' id words sent to other ranks (exchange/pooling.h)") \
  X(uint64_t, key_bytes_sent, "bytes of keys, their counts and bucket sizes sent to other ranks in key rounds")

#define SHARDREC_FIELD(type, name, doc) type name = 0;
struct IndexCounters {
  SHARDREC_INDEX_COUNTERS(SHARDREC_FIELD)
};
struct TierCounters {
  SHARDREC_TIER_COUNTERS(SHARDREC_FIELD)
};
struct ExchangeCounters {
  SHARDREC_EXCHANGE_COUNTERS(SHARDREC_FIELD)
  ExchangeCounters() { last_eviction_step = -1; }
};
#undef SHARDREC_FIELD

// Keys that have no row yet, counting towards admission, as a checkpoint holds them.
struct PendingKeys {
  std::vector<int64_t> keys, last_seen;
  std::vector<uint32_t> counts;
};

// An index's keys as a checkpoint sees them: each key with its row (in row order) and, for a
// table with admission as of one step, the counts, timestamps and keys still counting.
struct IndexState {
  std::vector<int64_t> keys, last_seen;
  std::vector<int32_t> rows;
  std::vector<uint32_t> counts;
  PendingKeys pending;
  std::vector<int64_t> removed;  // a delta save's keys removed since the previous save
  int64_t newest = -1;
  bool exact = true;  // false: the journal no longer reached back to the step asked for

  // Only the keys with key mod world == rank (non-negative), rows and admission state with them:
  // what one replica of a replicated table writes, so that the replicas' saves hold each key once.
  void keep_owned(int world, int rank) {
    if (world <= 1) return;
    auto owned = [&](int64_t k) {
      const int64_t r = k % world;
      return (r < 0 ? r + world : r) == rank;
    };
    size_t out = 0;
    const bool counted = counts.size() == keys.size();
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!owned(keys[i])) continue;
      keys[out] = keys[i];
      rows[out] = rows[i];
      if (counted) {
        counts[out] = counts[i];
        last_seen[out] = last_seen[i];
      }
      ++out;
    }
    keys.resize(out);
    rows.resize(out);
    if (counted) {
      counts.resize(out);
      last_seen.resize(out);
    }
    size_t p = 0;
    for (size_t i = 0; i < pending.keys.size(); ++i) {
      if (!owned(pending.keys[i])) continue;
      pending.keys[p] = pending.keys[i];
      pending.counts[p] = pending.counts[i];
      pending.last_seen[p] = pending.last_seen[i];
      ++p;
    }
    pending.keys.resize(p);
    pending.counts.resize(p);
    pending.last_seen.resize(p);
    removed.erase(std::remove_if(removed.begin(), removed.end(), [&](int64_t k) { return !owned(k); }), removed.end());
  }
};

}  // namespace shardrec
