// Routing of one batch's keys, all features at once: dedup each feature's ids, bucket the unique
// ids by owner rank (key mod world size, the same rule for negative keys everywhere), and move
// the buckets to their owners with two collectives (bucket sizes, then the keys, unpadded). Plain
// MPI on int64 buckets: what the owners do with the keys is key_exchange.h's business. A feature
// whose table counts keys (admission) also sends, per unique key, how often it occurs in the batch
// and its newest timestamp, in a third collective that runs only when some feature counts.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "storage/aligned_vector.h"
#include "index/batch_dedup.h"
#include "exchange/channel_comm.h"

namespace shardrec {

// Where a table's keys live (the sharding planner's placement, rank_runtime/embedding/planner.py):
// spread by key (row-wise), all on one rank (table-wise: that rank, >= 0), or on every rank. A
// column-wise table is a table-wise one over `slices` ranks from its rank on: each of them holds
// every key (its own columns), so each gets the same unique keys in the same order.
constexpr int kRowWise = -1;
constexpr int kReplicated = -2;

inline int owner_of(int64_t key, int world) {
  const int64_t r = key % world;
  return static_cast<int>(r < 0 ? r + world : r);
}

// owner_of for every unique key of a batch. A 64-bit division per key costs 40-90 cycles; for a
// world of a power of two, key mod world (non-negative) is key & (world - 1), negative keys too.
inline void owners_of(const int64_t* keys, size_t n, int world, int32_t* owners) {
  if ((world & (world - 1)) == 0) {
    const int64_t mask = world - 1;
    for (size_t u = 0; u < n; ++u) owners[u] = static_cast<int32_t>(keys[u] & mask);
  } else {
    for (size_t u = 0; u < n; ++u) owners[u] = owner_of(keys[u], world);
  }
}

struct RouterInput {
  const void* keys;
  bool keys_are_int32;
  size_t n;
  bool counted = false;  // send each unique key's occurrences and newest timestamp with it
  // A pooled feature's examples: ragged row splits (examples + 1 of them); nullptr otherwise.
  const int64_t* splits = nullptr;
  size_t examples = 0;
  int placement = kRowWise;  // kRowWise, kReplicated or the (first) rank of a table-wise table
  int slices = 1;            // column-wise: the ranks placement .. placement + slices - 1
};

// The batch's per-sample timestamps (the is_timestamp feature): id i of a feature with n ids
// belongs to sample i / (n / samples).
struct BatchTimestamps {
  const int64_t* ts = nullptr;
  size_t samples = 0;
};

class KeyRouter {
 public:
  // Dedups and buckets every feature; restore[f][i] is id i's index among feature f's unique ids.
  void bucket(const std::vector<RouterInput>& in, int world, std::vector<RoutingVector>& restore,
              BatchTimestamps ts = {}) {
    nf_ = in.size();
    world_ = world;
    unique_.resize(nf_);
    owner_.resize(nf_);
    place_.resize(nf_);
    meta_.resize(nf_);
    replicated_.assign(nf_, false);
    fan_first_.assign(nf_, 0);
    fan_count_.assign(nf_, 0);
    counted_ = false;
    counts_.assign(nf_, std::vector<int32_t>(world_, 0));
    restore.resize(nf_);
    for (size_t f = 0; f < nf_; ++f) {
      restore[f].resize(in[f].n);
      if (in[f].keys_are_int32)
        dedup_.run(static_cast<const int32_t*>(in[f].keys), in[f].n, unique_[f], restore[f].data());
      else
        dedup_.run(static_cast<const int64_t*>(in[f].keys), in[f].n, unique_[f], restore[f].data());
      const size_t nu = unique_[f].size();
      owner_[f].resize(nu);
      place_[f].resize(nu);
      replicated_[f] = in[f].placement == kReplicated;
      if (in[f].placement == kRowWise) {
        owners_of(unique_[f].data(), nu, world_, owner_[f].data());
        for (size_t u = 0; u < nu; ++u) place_[f][u] = counts_[f][owner_[f][u]]++;
      } else {
        // Table-wise (one owner, or a column-wise table's slice ranks) or replicated (every rank):
        // each of those ranks gets the unique keys in order.
        const int first = replicated_[f] ? 0 : in[f].placement;
        const int count = replicated_[f] ? world_ : in[f].slices;
        if (in[f].placement < kReplicated || count < 1 || first + count > world_)
          throw std::invalid_argument("placement " + std::to_string(in[f].placement) + " over " +
                                      std::to_string(in[f].slices) + " rank(s) outside the world of " +
                                      std::to_string(world_) + " ranks");
        fan_first_[f] = first;
        fan_count_[f] = count;
        std::fill(owner_[f].begin(), owner_[f].end(), in[f].placement);
        for (size_t u = 0; u < nu; ++u) place_[f][u] = static_cast<int32_t>(u);
        for (int r = first; r < first + count; ++r) counts_[f][r] = static_cast<int32_t>(nu);
      }
      if (in[f].counted) count(f, in[f], restore[f].data(), ts);
    }
  }

  // Sends every bucket to its owner. Afterwards received(f, s) are the keys of feature f that
  // rank s sent to this rank.
  void exchange(ChannelComm& comm) {
    const size_t w = static_cast<size_t>(world_);
    std::vector<int32_t> send_counts(w * nf_);  // laid out [peer][feature]
    recv_counts_.assign(w * nf_, 0);
    for (size_t r = 0; r < w; ++r)
      for (size_t f = 0; f < nf_; ++f) send_counts[r * nf_ + f] = counts_[f][r];
    comm.alltoall(send_counts.data(), recv_counts_.data(), static_cast<int>(nf_), "bucket sizes");
    const size_t me = static_cast<size_t>(comm.rank());
    bytes_sent_ = (w - 1) * nf_ * sizeof(int32_t);

    std::vector<int> sdispl(w + 1, 0), scount(w, 0), rcount(w, 0);
    rdispl_.assign(w + 1, 0);
    for (size_t r = 0; r < w; ++r) {
      for (size_t f = 0; f < nf_; ++f) {
        scount[r] += send_counts[r * nf_ + f];
        rcount[r] += recv_counts_[r * nf_ + f];
      }
      sdispl[r + 1] = sdispl[r] + scount[r];
      rdispl_[r + 1] = rdispl_[r] + rcount[r];
    }
    send_buf_.resize(static_cast<size_t>(sdispl[w]));
    recv_buf_.resize(static_cast<size_t>(rdispl_[w]));
    std::vector<int> base(sdispl.begin(), sdispl.end() - 1);
    for (size_t f = 0; f < nf_; ++f) {
      if (fan_count_[f] > 0)
        for (int r = fan_first_[f]; r < fan_first_[f] + fan_count_[f]; ++r)
          std::copy(unique_[f].begin(), unique_[f].end(), send_buf_.begin() + base[r]);
      else
        for (size_t u = 0; u < unique_[f].size(); ++u) send_buf_[base[owner_[f][u]] + place_[f][u]] = unique_[f][u];
      for (size_t r = 0; r < w; ++r) base[r] += counts_[f][r];
    }
    comm.alltoallv(send_buf_.data(), scount.data(), sdispl.data(), recv_buf_.data(), rcount.data(), rdispl_.data(),
                   "keys");
    const size_t others = static_cast<size_t>(sdispl[w] - scount[me]) * sizeof(int64_t);
    bytes_sent_ += counted_ ? 3 * others : others;  // a counted key's two words go with it
    if (!counted_) return;
    // Two words per key (occurrences, newest timestamp) at twice the key's position; features
    // that do not count send zeros.
    for (size_t r = 0; r < w; ++r) {
      scount[r] *= 2;
      rcount[r] *= 2;
      sdispl[r + 1] *= 2;
    }
    std::vector<int> rdispl2(rdispl_);
    for (auto& d : rdispl2) d *= 2;
    meta_send_.assign(send_buf_.size() * 2, 0);
    meta_recv_.resize(recv_buf_.size() * 2);
    base.assign(sdispl.begin(), sdispl.end() - 1);
    for (size_t f = 0; f < nf_; ++f) {
      if (!meta_[f].empty() && fan_count_[f] > 0)
        for (int r = fan_first_[f]; r < fan_first_[f] + fan_count_[f]; ++r)
          std::copy(meta_[f].begin(), meta_[f].end(), meta_send_.begin() + base[r]);
      else if (!meta_[f].empty())
        for (size_t u = 0; u < unique_[f].size(); ++u) {
          const size_t at = static_cast<size_t>(base[owner_[f][u]]) + 2 * static_cast<size_t>(place_[f][u]);
          meta_send_[at] = meta_[f][2 * u];
          meta_send_[at + 1] = meta_[f][2 * u + 1];
        }
      for (size_t r = 0; r < w; ++r) base[r] += 2 * counts_[f][r];
    }
    comm.alltoallv(meta_send_.data(), scount.data(), sdispl.data(), meta_recv_.data(), rcount.data(), rdispl2.data(),
                   "key counts");
  }

  size_t features() const { return nf_; }
  // Bytes the last exchange() sent to other ranks (bucket sizes, keys, counts).
  uint64_t bytes_sent() const { return bytes_sent_; }
  const std::vector<int64_t>& unique(size_t f) const { return unique_[f]; }
  // Unique keys of feature f this rank sends to `owner`.
  int32_t sent(size_t f, int owner) const { return counts_[f][owner]; }
  int32_t received_count(size_t f, int source) const { return recv_counts_[source * nf_ + f]; }
  const int64_t* received(size_t f, int source) const { return recv_buf_.data() + received_offset(f, source); }
  // Per received key: occurrences, newest timestamp (only when some feature counts).
  const int64_t* received_meta(size_t f, int source) const {
    return meta_recv_.data() + 2 * received_offset(f, source);
  }
  // Where unique key u of feature f sits among what `owner_of(u)` returns: owner and position
  // (a replicated feature's keys go to every rank, each at its place u: owner() is kReplicated).
  int owner(size_t f, size_t u) const { return owner_[f][u]; }
  bool replicated(size_t f) const { return replicated_[f]; }
  int32_t place(size_t f, size_t u) const { return place_[f][u]; }

 private:
  size_t received_offset(size_t f, int source) const {
    size_t offset = rdispl_[source];
    for (size_t g = 0; g < f; ++g) offset += recv_counts_[source * nf_ + g];
    return offset;
  }

  // Occurrences and newest timestamp of each unique key of feature f. A pooled feature's id takes
  // its example's timestamp (its row splits say which); any other's, the sample's of n / samples.
  void count(size_t f, const RouterInput& in, const int32_t* restore, BatchTimestamps ts) {
    counted_ = true;
    const size_t n = in.n;
    auto& m = meta_[f];
    m.assign(2 * unique_[f].size(), 0);
    if (in.splits != nullptr && ts.ts != nullptr && in.examples == ts.samples) {
      for (size_t sample = 0; sample < ts.samples; ++sample)
        for (int64_t i = in.splits[sample]; i < in.splits[sample + 1]; ++i) {
          int64_t* e = &m[2 * static_cast<size_t>(restore[i])];
          e[0] += 1;
          e[1] = std::max(e[1], ts.ts[sample]);
        }
      return;
    }
    const size_t per = ts.ts != nullptr && ts.samples > 0 ? n / ts.samples : 0;
    if (per == 0) {
      for (size_t i = 0; i < n; ++i) m[2 * static_cast<size_t>(restore[i])] += 1;
      return;
    }
    for (size_t sample = 0, i = 0; sample < ts.samples; ++sample) {
      const int64_t t = ts.ts[sample];
      for (size_t j = 0; j < per; ++j, ++i) {
        int64_t* e = &m[2 * static_cast<size_t>(restore[i])];
        e[0] += 1;
        e[1] = std::max(e[1], t);
      }
    }
  }

  size_t nf_ = 0;
  uint64_t bytes_sent_ = 0;
  bool counted_ = false;
  std::vector<std::vector<int64_t>> meta_;  // per feature: 2 words per unique key, empty if not counted
  std::vector<int64_t> meta_send_, meta_recv_;
  int world_ = 1;
  BatchDedup dedup_;
  std::vector<std::vector<int64_t>> unique_;
  std::vector<bool> replicated_;
  // Per feature whose unique keys all go to a run of ranks (table-wise, column-wise, replicated):
  // the first of them and how many (0: row-wise, each key to its own owner).
  std::vector<int> fan_first_, fan_count_;
  std::vector<std::vector<int32_t>> owner_, place_, counts_;
  std::vector<int32_t> recv_counts_;
  std::vector<int> rdispl_;
  std::vector<int64_t> send_buf_, recv_buf_;
};

}  // namespace shardrec
