// The key exchange of one channel (train or eval) for one batch, all its features at once:
//   1. a status round (every rank's: has data, feature-set signature, static-shape overflow, an
//      id outside its table's key dtype), so that what one rank decides stops every rank at the
//      same batch: end of data, features that differ between ranks, an overflow, a bad id;
//   2. routing (key_router.h): unique ids to their owners;
//   3. resolving: the owner maps received ids to rows of its shard and dedups them, and the
//      requester computes where each of its ids' rows comes back;
//   4. on the allocating (train) channel, an agreement round: a full table on any rank stops
//      every rank in this round, before any rank moves rows.
// Every round is bound by the channel's deadline (channel_comm.h). After any error the channel
// is stopped on every rank: each later batch raises the same error without a collective, so
// ranks never drift out of step.
//
// Admission and eviction ride on the same rounds: the status round also carries each rank's
// newest timestamp and whether it asks for an eviction (EvictHook's time interval), so every rank
// evicts in the same round, before the batch's keys are resolved; an eviction by step interval
// needs no word, as every rank counts the same steps.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "storage/aligned_vector.h"
#include "index/batch_dedup.h"
#include "exchange/channel.h"
#include "exchange/channel_comm.h"
#include "index/embedding_index.h"
#include "exchange/key_router.h"
#include "exchange/feature_set.h"
#include "exchange/pass_closing.h"
#include "exchange/round_status.h"

namespace shardrec {

class KeyExchange {
 public:
  // The training channel allocates rows (and counts, and evicts); the evaluation channel only looks up.
  KeyExchange(MPI_Comm comm, Channel channel, double timeout_s)
      : comm_(comm, name_of(channel), timeout_s), channel_(channel), allocate_(channel == Channel::kTrain) {}

  int rank() const { return comm_.rank(); }
  int world() const { return comm_.world(); }
  Channel channel() const { return channel_; }
  ChannelComm& comm() { return comm_; }
  ExchangeCounters counters() const { return counters_; }
  const std::string& stopped() const { return stopped_; }
  // A new configuration (init() again) starts from a running channel, unless a round timed out:
  // an abandoned collective cannot be taken back. Its steps are numbered afresh.
  void restart() {
    say(pass_.reopen());
    if (comm_.broken().empty()) stopped_.clear();
    step_ = 0;
    step_follows_training_ = false;
    evict_every_ = 0;
  }
  // At exit: tells every peer's pending (or next) status round on this channel that this rank has
  // left. A peer whose prefetch had started one batch more than this rank when the sessions closed
  // would otherwise wait for this rank until the timeout; that round fails at once instead, and so
  // does a pass a peer runs without this rank (throw_if_a_rank_left).
  void leave() {
    if (left_ || comm_.world() == 1) return;
    left_ = true;
    // Static: the sends may still be in flight when this object is gone (they complete in MPI_Finalize).
    static const RankStatus kLeaveStatus = RankStatus::left();
    comm_.post_status(reinterpret_cast<const int64_t*>(&kLeaveStatus), sizeof(RankStatus) / sizeof(int64_t));
  }

  void close_pass() { say(pass_.close()); }  // no round begins until reopen_pass() (pass_closing.h)
  bool pass_closing() { return pass_.closing(); }
  void reopen_pass() { say(pass_.reopen()); }

  // Eviction on the training channel: every `step_interval` steps (0: never).
  void set_eviction(int64_t step_interval) { evict_every_ = step_interval; }
  // The training step the next batch follows (the global step a session starts or resumes at).
  void set_step(int64_t step) {
    step_ = step;
    step_follows_training_ = true;
  }
  // Whether the step numbering was set from a global step (a session's start or a restore), so
  // that a checkpoint of global step T may take back what was counted for batches T, T+1, ...
  bool step_follows_training() const { return step_follows_training_; }
  int64_t step() const { return step_; }
  // EvictHook's time interval: the next status round asks every rank to evict.
  void request_eviction() { evict_asked_.store(true); }
  // An incremental job's save timer (rank 0's clock): the next round asks every rank to save once
  // the training step reaches that round's batch, the same step on every rank.
  void request_save() { save_asked_.store(true); }
  // The global step whose save the last such round asked for (-1: none yet).
  int64_t save_request_step() const { return save_request_step_.load(); }

  // The ranks whose data ended, after run() returned false.
  const std::vector<int>& ranks_out_of_data() const { return ranks_out_of_data_; }

  // Returns false when some rank has no more data: every rank returns false at the same batch.
  // `keys[f]` are the ids of features.features[f] (ignored when has_data is false).
  bool run(const FeatureSet& fs, const std::vector<RouterInput>& keys, bool has_data,
           std::vector<FeatureRouting>& out, BatchTimestamps ts = {}) {
    if (!stopped_.empty())
      throw ExchangeError(stopped_ + " [this channel stopped at batch " + std::to_string(stopped_at_) +
                          "; every later batch raises this error on every rank]");
    try {
      return run_checked(fs, keys, has_data, out, ts);
    } catch (const ExchangeError& e) {
      stopped_ = e.what();
      stopped_at_ = counters_.batches;
      throw;
    }
  }

 private:

  // The round's stages: this rank's status (and its keys bucketed by owner), the status round,
  // the keys to their owners, each feature resolved, the agreement that no table failed.
  bool run_checked(const FeatureSet& fs, std::vector<RouterInput> keys, bool has_data,
                   std::vector<FeatureRouting>& out, BatchTimestamps ts) {
    // Training lookups of a table with admission count their keys on the owner.
    for (size_t f = 0; f < keys.size() && f < fs.features.size(); ++f) {
      keys[f].counted = allocate_ && fs.features[f].index->counts();
      keys[f].placement = fs.features[f].placement;
      keys[f].slices = fs.features[f].slices;
    }
    const auto t0 = std::chrono::steady_clock::now();
    cpu_ns0_ = thread_cpu_ns();
    coll_ns0_ = comm_.ns_waiting();
    out.assign(fs.features.size(), FeatureRouting{});
    const RoundId id = pass_.begin_round(comm_.channel());
    struct RoundEnd {
      KeyExchange& ex;
      ~RoundEnd() { ex.say(ex.pass_.end_round()); }
    } round_end{*this};
    RankStatus status = prepare(fs, keys, has_data, ts);
    status.epoch = id.epoch;
    status.round = id.round;
    std::vector<RankStatus> all = comm_.gather_words(status, "status round");
    drop_earlier_words(comm_, all, id);
    throw_if_a_rank_left(comm_, all);
    throw_if_a_session_closed(comm_, pass_, all, counters_.batches + 1);
    for (const RankStatus& s : all)
      if (s.signature != fs.signature && s.signature != RankStatus::kLeft) throw_feature_mismatch(fs);
    ranks_out_of_data_.clear();
    for (int r = 0; r < comm_.world(); ++r)
      if (all[r].has_data == 0) ranks_out_of_data_.push_back(r);
    if (!ranks_out_of_data_.empty()) {
      finish(t0);
      return false;
    }
    throw_if_refused(fs, all);
    if (allocate_) evict_and_observe(fs, all);
    if (allocate_ && std::any_of(all.begin(), all.end(), [](const RankStatus& s) { return s.save_asked != 0; }))
      save_request_step_.store(step_ + 1);  // the step that trains this batch
    router_.exchange(comm_);
    counters_.key_bytes_sent += router_.bytes_sent();
    begin_batch(fs, out);
    resolve_all(fs, out);
    pool(fs, keys, out);
    if (allocate_) ++step_;
    finish(t0);
    return true;
  }

  void say(const RankStatus* word) {  // a close word to every peer, unread where the channel stopped
    if (word != nullptr && comm_.world() > 1)
      comm_.post_status(reinterpret_cast<const int64_t*>(word), sizeof(RankStatus) / sizeof(int64_t));
  }

  // This rank's status for the round; with data, its keys checked and bucketed by owner.
  RankStatus prepare(const FeatureSet& fs, const std::vector<RouterInput>& keys, bool has_data, BatchTimestamps ts) {
    RankStatus status;
    status.has_data = has_data ? 1 : 0;
    status.signature = fs.signature;
    if (allocate_ && evict_asked_.exchange(false)) status.evict_asked = 1;
    if (allocate_ && save_asked_.exchange(false)) status.save_asked = 1;
    if (!has_data) return status;
    const size_t nf = fs.features.size();
    const int world = comm_.world();
    if (keys.size() != nf) throw std::invalid_argument("one id array per feature expected");
    check_key_range(fs, keys, status);
    if (!fs.timestamp_feature.empty()) check_timestamps(keys, ts, status);
    restore_.clear();
    router_.bucket(keys, world, restore_, status.bad_ts < 0 ? ts : BatchTimestamps{});
    for (size_t f = 0; f < nf && status.overflow_feature < 0; ++f) {
      for (int r = 0; r < world; ++r) {
        if (fs.features[f].send_count > 0 && router_.sent(f, r) > fs.features[f].send_count) {
          status.overflow_feature = static_cast<int64_t>(f);
          status.overflow_count = router_.sent(f, r);
          status.overflow_owner = r;
          break;
        }
      }
    }
    return status;
  }

  // The pooled features' extra collective, once the keys are resolved on every rank.
  void pool(const FeatureSet& fs, const std::vector<RouterInput>& keys, std::vector<FeatureRouting>& out) {
    std::vector<PoolInput> in;
    std::vector<size_t> which;
    for (size_t f = 0; f < fs.features.size(); ++f) {
      if (!fs.features[f].pooled) continue;
      if (fs.features[f].placement == kReplicated && comm_.world() > 1) {
        // Every rank holds every row: the requester pools its own ids (rank_runtime/pipeline/lookup.py).
        PoolRouting& none = out[f].pool;
        for (RoutingVector* v : {&none.partial_send_splits, &none.occ_recv_splits, &none.partial_recv_splits,
                                 &none.occ_send_splits})
          v->assign(static_cast<size_t>(comm_.world()), 0);
        continue;
      }
      std::vector<int32_t> received(static_cast<size_t>(comm_.world()));
      for (int s = 0; s < comm_.world(); ++s) received[s] = router_.received_count(f, s);
      const FeatureRouting& o = out[f];
      const RouterInput& k = keys[f];
      const bool share = fs.features[f].pooled == 2;
      in.push_back(k.keys_are_int32
                       ? pool_input(static_cast<const int32_t*>(k.keys), k.splits, k.examples, share, o.restore,
                                    o.recv_splits, o.send_splits, o.expand, std::move(received), k.placement,
                                    k.slices)
                       : pool_input(static_cast<const int64_t*>(k.keys), k.splits, k.examples, share, o.restore,
                                    o.recv_splits, o.send_splits, o.expand, std::move(received), k.placement,
                                    k.slices));
      which.push_back(f);
    }
    if (which.empty()) return;
    std::vector<PoolRouting> pools;
    pooler_.run(comm_, in, pools);
    counters_.pool_bytes_sent += pooler_.bytes_sent();
    for (size_t p = 0; p < which.size(); ++p) out[which[p]].pool = std::move(pools[p]);
  }

  // Resolves every feature; a full table or a failing tier on any rank stops every rank here.
  void resolve_all(const FeatureSet& fs, std::vector<FeatureRouting>& out) {
    std::string capacity_error, tier_error;
    int64_t full_feature = -1;
    for (size_t f = 0; f < fs.features.size(); ++f) {
      try {
        resolve(fs.features[f], f, out[f]);
      } catch (const CapacityError& e) {
        // A table with an SSD tier explains its own limits (pinned rows, its SSD share, a full disk).
        (fs.features[f].index->tiered() ? tier_error : capacity_error) = e.what();
        full_feature = static_cast<int64_t>(f);
        break;
      } catch (const std::exception& e) {  // a damaged SSD file: every rank must learn of it too
        tier_error = e.what();
        full_feature = static_cast<int64_t>(f);
        break;
      }
    }
    // Eval lookups allocate nothing, but with an SSD tier they move rows and may fail too.
    if (allocate_ || any_tiered(fs)) agree_on_capacity(fs, full_feature, capacity_error, tier_error);
    // Unreachable today (the agreement has thrown on every rank); kept so that a full table can
    // never pass silently if a channel stops agreeing.
    if (full_feature >= 0) throw ExchangeError(capacity_error + tier_error);
  }

  // Timestamps: one int64 per sample, none negative, and every counted feature's ids a whole
  // number per sample.
  static void check_timestamps(const std::vector<RouterInput>& keys, BatchTimestamps ts, RankStatus& status) {
    for (size_t i = 0; i < ts.samples; ++i) {
      if (ts.ts[i] < 0) {
        status.bad_ts = 0;
        status.bad_ts_value = ts.ts[i];
        return;
      }
      status.newest_ts = std::max(status.newest_ts, ts.ts[i]);
    }
    for (const auto& k : keys) {
      const bool fits = k.splits != nullptr ? k.examples == ts.samples
                        : ts.samples == 0   ? k.n == 0
                                            : k.n % ts.samples == 0;
      if (k.counted && !fits) {
        status.bad_ts = 1;
        status.bad_ts_value = static_cast<int64_t>(ts.samples);
        return;
      }
    }
  }

  // Before this batch's keys are resolved: an eviction if any rank asks for one or the step
  // interval says so, then the newest timestamp of every rank's batch.
  void evict_and_observe(const FeatureSet& fs, const std::vector<RankStatus>& all) {
    bool asked = evict_every_ > 0 && step_ > 0 && step_ % evict_every_ == 0;
    int64_t newest = -1;
    for (const RankStatus& s : all) {
      asked = asked || s.evict_asked != 0;
      newest = std::max(newest, s.newest_ts);
    }
    std::vector<EmbeddingIndex*> seen;
    for (const auto& f : fs.features) {
      if (!f.index->counts() || std::find(seen.begin(), seen.end(), f.index) != seen.end()) continue;
      seen.push_back(f.index);
      f.index->begin_step(step_);
      if (asked && f.index->evicts()) f.index->evict(step_);
      if (newest >= 0) f.index->observe_newest(newest);
    }
    if (asked) {
      counters_.evictions += 1;
      counters_.last_eviction_step = step_;
    }
  }

  // An int64 id into an int32 table is refused, not truncated: two ids would share a row.
  static void check_key_range(const FeatureSet& fs, const std::vector<RouterInput>& keys, RankStatus& status) {
    for (size_t f = 0; f < keys.size(); ++f) {
      if (!fs.features[f].int32_keys || keys[f].keys_are_int32) continue;
      const int64_t* k = static_cast<const int64_t*>(keys[f].keys);
      for (size_t i = 0; i < keys[f].n; ++i) {
        if (k[i] < std::numeric_limits<int32_t>::min() || k[i] > std::numeric_limits<int32_t>::max()) {
          status.bad_feature = static_cast<int64_t>(f);
          status.bad_key = k[i];
          return;
        }
      }
    }
  }

  void throw_feature_mismatch(const FeatureSet& fs) {
    std::vector<std::string> all;
    all = comm_.gather_strings(fs.description, "feature-list check");
    auto lines = [](const std::string& s) {
      std::vector<std::string> out;
      std::istringstream in(s);
      for (std::string line; std::getline(in, line);) out.push_back(line);
      return out;
    };
    const auto mine = lines(all[0]);
    for (size_t r = 1; r < all.size(); ++r) {
      const auto theirs = lines(all[r]);
      for (size_t i = 0; i < std::max(mine.size(), theirs.size()); ++i) {
        const std::string a = i < mine.size() ? mine[i] : "(nothing)";
        const std::string b = i < theirs.size() ? theirs[i] : "(nothing)";
        if (a == b) continue;
        throw ExchangeError("the ranks' features on key exchange '" + comm_.channel() + "' differ at entry " +
                            std::to_string(i + 1) + ": rank 0 has " + a + ", rank " + std::to_string(r) + " has " +
                            b + ". Every rank must build the same FeatureSpecs (names, tables, dims, key dtypes, "
                            "send_count, thresholds, timestamp feature) for the same dataset (every rank stops here)");
      }
    }
    throw ExchangeError("the ranks' feature signatures differ on key exchange '" + comm_.channel() +
                        "' although their descriptions match (every rank stops here)");
  }

  // Ids outside an int32 table, bad timestamps and static-shape overflows, on any rank: every
  // rank stops in this round with the same message.
  void throw_if_refused(const FeatureSet& fs, const std::vector<RankStatus>& all) {
    std::string bad, bad_ts, overflow;
    int64_t largest = 0;
    for (int r = 0; r < comm_.world(); ++r) {
      const RankStatus& s = all[r];
      const std::string rank = std::to_string(r);
      if (s.bad_feature >= 0) {
        const auto& f = fs.features[static_cast<size_t>(s.bad_feature)];
        bad += (bad.empty() ? "" : "; ") + std::string("feature '") + f.name + "' on rank " + rank + " has id " +
               std::to_string(s.bad_key) + ", outside table '" + f.index->name() +
               "''s key dtype int32 [-2147483648, 2147483647]";
      }
      if (s.bad_ts == 0)
        bad_ts += (bad_ts.empty() ? "" : "; ") + std::string("rank ") + rank + " has timestamp " +
                  std::to_string(s.bad_ts_value) + " in is_timestamp feature '" + fs.timestamp_feature +
                  "'; timestamps must be seconds >= 0";
      else if (s.bad_ts == 1)
        bad_ts += (bad_ts.empty() ? "" : "; ") + std::string("rank ") + rank + " has " +
                  std::to_string(s.bad_ts_value) + " timestamps in is_timestamp feature '" + fs.timestamp_feature +
                  "', which do not divide the ids of a feature that counts (or, for a variable-length feature, are "
                  "not one per example): give one timestamp per sample "
                  "(shape [batch])";
      if (s.overflow_feature >= 0) {
        const auto& f = fs.features[static_cast<size_t>(s.overflow_feature)];
        largest = std::max(largest, s.overflow_count);
        overflow += (overflow.empty() ? "" : "; ") + std::string("feature '") + f.name + "' of table '" +
                    f.index->name() + "': rank " + rank + " has " + std::to_string(s.overflow_count) +
                    " unique keys for rank " + std::to_string(s.overflow_owner) +
                    ", more than send_count=" + std::to_string(f.send_count);
      }
    }
    if (!bad.empty())
      throw ExchangeError(bad + "; create the table with key_dtype=tf.int64 or map the ids into int32 "
                                "(every rank stops here)");
    if (!bad_ts.empty()) throw ExchangeError(bad_ts + " (every rank stops here)");
    if (!overflow.empty())
      throw ExchangeError(overflow + "; raise send_count to at least " + std::to_string(largest) +
                          " (every rank stops here)");
  }

  static bool any_tiered(const FeatureSet& fs) {
    for (const auto& f : fs.features)
      if (f.index->tiered()) return true;
    return false;
  }

  // Each distinct table of the round starts a batch; its ticket goes with every feature of it.
  void begin_batch(const FeatureSet& fs, std::vector<FeatureRouting>& out) {
    for (size_t f = 0; f < fs.features.size(); ++f) {
      size_t first = 0;
      while (fs.features[first].index != fs.features[f].index) ++first;
      out[f].ticket = first == f ? static_cast<int32_t>(fs.features[f].index->begin_batch(channel_)) : out[first].ticket;
    }
  }

  // Every rank learns, in the same round, whether any rank's lookup failed: a full table (its
  // rows in the message), or another error of a tier (each failing rank's own message).
  void agree_on_capacity(const FeatureSet& fs, int64_t full_feature, const std::string& capacity_error,
                         const std::string& tier_error) {
    CapacityStatus mine;
    mine.full_feature = tier_error.empty() ? full_feature : -1;
    mine.tier_failed = tier_error.empty() ? 0 : 1;
    if (mine.full_feature >= 0) {
      EmbeddingIndex* index = fs.features[static_cast<size_t>(full_feature)].index;
      // A table that grows stops at its memory limit (or at the most rows an index holds).
      mine.rows = index->expands() ? index->store().in_use() : index->capacity();
      mine.memory_limit = index->expands() ? index->store().memory_limit() : 0;
    }
    const std::vector<CapacityStatus> all = comm_.gather_words(mine, "capacity agreement");
    bool tier_failed = false;
    for (const CapacityStatus& s : all) tier_failed = tier_failed || s.tier_failed != 0;
    if (tier_failed) {
      const auto texts = comm_.gather_strings(tier_error, "tier errors");
      std::string msg;
      for (size_t r = 0; r < texts.size(); ++r)
        if (!texts[r].empty())
          msg += (msg.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + ": " + texts[r];
      throw ExchangeError(msg + " (every rank stops here)");
    }
    throw_if_full(fs, all);
  }

  void throw_if_full(const FeatureSet& fs, const std::vector<CapacityStatus>& all) const {
    std::string full;
    bool grows = false;
    for (size_t r = 0; r < all.size(); ++r) {
      const CapacityStatus& s = all[r];
      if (s.full_feature < 0) continue;
      const auto& f = fs.features[static_cast<size_t>(s.full_feature)];
      const std::string rows = std::to_string(s.rows);
      full += (full.empty() ? "" : "; ") + std::string("table '") + f.index->name();
      if (s.memory_limit > 0) {
        grows = true;
        full += "' reached its memory limit of " + std::to_string(s.memory_limit) + " bytes on rank " +
                std::to_string(r) + " (" + rows + " rows in use, reached by feature '" + f.name + "')";
      } else {
        full += "' is full on rank " + std::to_string(r) + " (" + rows + " rows per rank, reached by feature '" +
                f.name + "')";
      }
    }
    if (!full.empty())
      throw ExchangeError(full + (grows ? "; raise SHARDREC_TABLE_MEMORY_LIMIT (bytes per table and rank, suffixes "
                                          "K/M/G/T), or evict keys (every rank stops here)"
                                        : "; raise the table's device_vocabulary_size, or grow it with "
                                          "init(use_dynamic_expansion=True) (every rank stops here)"));
  }

  void resolve(const ExchangeFeature& feature, size_t f, FeatureRouting& o) {
    const int world = comm_.world();
    const int64_t pad = feature.send_count;
    o.send_splits.resize(world);
    o.recv_splits.resize(world);
    std::vector<int32_t> back_base(world + 1, 0);  // where each owner's rows start among those returned
    size_t total_recv = 0;
    for (int s = 0; s < world; ++s) {
      o.send_splits[s] = pad > 0 ? static_cast<int32_t>(pad) : router_.received_count(f, s);
      o.recv_splits[s] = pad > 0 ? static_cast<int32_t>(pad) : router_.sent(f, s);
      back_base[s + 1] = back_base[s] + o.recv_splits[s];
      total_recv += o.send_splits[s];
    }
    // Owner side: received keys -> local rows, in source-rank order (padding keeps the sentinel).
    o.rows.assign(total_recv, feature.index->sentinel());
    size_t dst = 0;
    if (allocate_ && feature.index->counts()) {
      resolve_counted(feature, f, o);
    } else {
      for (int s = 0; s < world; ++s) {
        const int32_t n = router_.received_count(f, s);
        feature.index->lookup(router_.received(f, s), static_cast<size_t>(n), allocate_, o.rows.data() + dst);
        feature.index->add_traffic(router_.sent(f, s), n);
        dst += o.send_splits[s];
      }
    }
    // Distinct rows on the owner, so the optimizer needs no dedup of its own. With one rank and
    // no padding the received keys are this batch's unique keys already: no expand needed.
    if (world > 1 || pad > 0) {
      o.expand.resize(o.rows.size());
      owner_dedup_.run(o.rows.data(), o.rows.size(), owner_unique_, o.expand.data());
      o.rows.assign(owner_unique_.begin(), owner_unique_.end());
    }
    if (feature.index->tiered()) check_memory_budget(feature, o);
    // Requester side: each id's row among those that come back, laid out by owner rank.
    const auto& unique = router_.unique(f);
    std::vector<int32_t> back(unique.size());
    // A replicated table's rows are this rank's own: the lookup reads them from its own block.
    if (router_.replicated(f))
      for (size_t u = 0; u < unique.size(); ++u) back[u] = router_.place(f, u);
    else
      for (size_t u = 0; u < unique.size(); ++u) back[u] = back_base[router_.owner(f, u)] + router_.place(f, u);
    o.restore.swap(restore_[f]);
    for (auto& r : o.restore) r = back[r];
  }

  // A memory tier must hold the distinct keys of two batches: the one training and the next.
  void check_memory_budget(const ExchangeFeature& feature, const FeatureRouting& o) const {
    const int64_t distinct = static_cast<int64_t>(o.rows.size());
    const int64_t rows = feature.index->capacity();
    if (2 * distinct > rows)
      throw CapacityError("table '" + feature.index->name() + "': its memory budget of " + std::to_string(rows) +
                          " rows per rank ((device_vocabulary_size + host_vocabulary_size) / ranks) is smaller than two "
                          "batches' distinct keys: feature '" + feature.name + "' brought " + std::to_string(distinct) +
                          " to rank " + std::to_string(comm_.rank()) + " in one batch; raise host_vocabulary_size to "
                          "at least " + std::to_string(2 * distinct * comm_.world()) + " in all");
  }

  // Admission decides on a key's count over the whole batch, every requester's occurrences
  // together, so that every rank asking for a key in one batch gets the same answer: the received
  // keys of all requesters are merged (counts summed, newest timestamp kept) before the lookup.
  void resolve_counted(const ExchangeFeature& feature, size_t f, FeatureRouting& o) {
    const int world = comm_.world();
    if (world == 1) {  // one requester: its keys are distinct already
      const int32_t n = router_.received_count(f, 0);
      feature.index->lookup_counted(router_.received(f, 0), router_.received_meta(f, 0), static_cast<size_t>(n),
                                    o.rows.data());
      feature.index->add_traffic(router_.sent(f, 0), n);
      return;
    }
    merged_keys_.clear();
    for (int s = 0; s < world; ++s) {
      const int64_t* k = router_.received(f, s);
      merged_keys_.insert(merged_keys_.end(), k, k + router_.received_count(f, s));
    }
    merged_restore_.resize(merged_keys_.size());
    key_dedup_.run(merged_keys_.data(), merged_keys_.size(), merged_unique_, merged_restore_.data());
    merged_meta_.assign(2 * merged_unique_.size(), 0);
    size_t i = 0;
    for (int s = 0; s < world; ++s) {
      const int64_t* meta = router_.received_meta(f, s);
      for (int32_t j = 0; j < router_.received_count(f, s); ++j, ++i) {
        int64_t* m = &merged_meta_[2 * static_cast<size_t>(merged_restore_[i])];
        m[0] += meta[2 * j];
        m[1] = std::max(m[1], meta[2 * j + 1]);
      }
    }
    merged_rows_.resize(merged_unique_.size());
    feature.index->lookup_counted(merged_unique_.data(), merged_meta_.data(), merged_unique_.size(),
                                  merged_rows_.data());
    size_t dst = 0;
    i = 0;
    for (int s = 0; s < world; ++s) {
      const int32_t n = router_.received_count(f, s);
      for (int32_t j = 0; j < n; ++j, ++i) o.rows[dst + j] = merged_rows_[merged_restore_[i]];
      feature.index->add_traffic(router_.sent(f, s), n);
      dst += o.send_splits[s];
    }
  }

  void finish(std::chrono::steady_clock::time_point t0) {
    counters_.batches += 1;
    counters_.ns_in_collectives += comm_.ns_waiting() - coll_ns0_;
    counters_.ns_total += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    counters_.ns_cpu += thread_cpu_ns() - cpu_ns0_;
  }

  // The calling thread's CPU time: its own work, which wall time mixes with the time other threads
  // of the rank held the core.
  static uint64_t thread_cpu_ns() {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<uint64_t>(t.tv_sec) * 1000000000ULL + static_cast<uint64_t>(t.tv_nsec);
  }

  ChannelComm comm_;
  const Channel channel_;
  bool left_ = false;
  int64_t evict_every_ = 0;
  int64_t step_ = 0;
  bool step_follows_training_ = false;
  std::atomic<bool> evict_asked_{false};
  std::atomic<bool> save_asked_{false};
  std::atomic<int64_t> save_request_step_{-1};
  const bool allocate_;
  KeyRouter router_;
  KeyPooler pooler_;
  RowDedup owner_dedup_;
  BatchDedup key_dedup_;  // merges the requesters' keys of a counted feature
  std::vector<int64_t> merged_keys_, merged_unique_, merged_meta_;
  std::vector<int32_t> merged_restore_, merged_rows_;
  std::vector<int32_t> owner_unique_;
  std::vector<RoutingVector> restore_;
  uint64_t coll_ns0_ = 0;
  uint64_t cpu_ns0_ = 0;
  ExchangeCounters counters_;
  std::string stopped_;
  uint64_t stopped_at_ = 0;
  std::vector<int> ranks_out_of_data_;
  PassClosing pass_;
};

}  // namespace shardrec
