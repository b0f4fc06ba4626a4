// The words every rank gives in a key exchange round's collectives (key_exchange.h): its status
// before the keys move, and after the lookups whether a table failed. Plain int64 fields, gathered
// as they are.
#pragma once

#include <cstdint>

namespace shardrec {

// What each rank says in a batch's status round, gathered from every rank.
struct RankStatus {
  // The signature of a rank that left (leave()), whatever features the round is for.
  static constexpr int64_t kLeft = INT64_MIN;
  // The signature of a rank whose session closed before it began this round (pass_closing.h).
  static constexpr int64_t kSessionClosed = INT64_MIN + 1;
  // The session (epoch) and round this word is for (pass_closing.h); a left rank's is for every one.
  int64_t epoch = 0, round = 0;
  int64_t has_data = 0;
  int64_t signature = 0;  // of the rank's feature set
  // A static-shape overflow: the first feature whose unique keys for one owner exceed send_count.
  int64_t overflow_feature = -1, overflow_count = 0, overflow_owner = 0;
  int64_t bad_feature = -1, bad_key = 0;  // an id outside its table's int32 key dtype
  int64_t evict_asked = 0;  // this rank's EvictHook asks for an eviction now
  int64_t save_asked = 0;   // this rank's save timer asks for a checkpoint (save_schedule.py)
  int64_t newest_ts = -1;   // the newest timestamp of this rank's batch (-1: none)
  // -1, or 0: a negative timestamp (bad_ts_value), 1: bad_ts_value samples for ids that do not fit.
  int64_t bad_ts = -1, bad_ts_value = 0;

  static RankStatus left() {
    RankStatus s;
    s.signature = kLeft;
    s.epoch = s.round = INT64_MAX;
    return s;
  }
  // Closed after `round` rounds of session `epoch`.
  static RankStatus session_closed(int64_t epoch, int64_t round) {
    RankStatus s;
    s.signature = kSessionClosed;
    s.epoch = epoch;
    s.round = round;
    return s;
  }
};

// Every rank's word, after a lookup: whether a table of the round is full or a tier failed.
struct CapacityStatus {
  int64_t full_feature = -1;  // the feature whose table is full (-1: none)
  int64_t rows = 0;           // the rows it holds
  int64_t memory_limit = 0;   // a growing table's memory limit (0: a table of fixed size)
  int64_t tier_failed = 0;    // 1: a tier's error, which every rank is told in text
};

}  // namespace shardrec
