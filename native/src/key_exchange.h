// The all-to-all key exchange of one channel (train or eval) for one batch, all its features at
// once: dedup each feature's ids, send every unique id to its owner rank (key mod world size,
// the same rule for negative keys everywhere), map received ids to local rows on the owner, and
// return what the graph needs to move rows back: local slots, send / receive splits, restore
// indices. Three collectives per batch whatever the number of features:
//   1. MPI_Allgather of each rank's status (has data, static-shape overflow) so that an
//      end of data or an overflow stops every rank at the same batch instead of hanging;
//   2. MPI_Alltoall of the bucket sizes;  3. MPI_Alltoallv of the keys.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "batch_dedup.h"
#include "embedding_index.h"

namespace shardrec {

inline int owner_of(int64_t key, int world) {
  const int64_t r = key % world;
  return static_cast<int>(r < 0 ? r + world : r);
}

struct FeatureInput {
  EmbeddingIndex* index;
  const void* keys;
  bool keys_are_int32;
  size_t n;
  int64_t send_count;  // 0: dynamic shapes; else every bucket is padded to it
};

struct FeatureOutput {
  std::vector<int32_t> local_slots;   // distinct rows this rank gathers for its requesters
  std::vector<int32_t> expand;        // per received key, its row among local_slots (empty: identity)
  std::vector<int32_t> send_splits;   // rows coming back from each owner
  std::vector<int32_t> recv_splits;   // rows going out to each requester
  std::vector<int32_t> restore;       // per id of the batch: its row among those that come back
};

class ExchangeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ExchangeCounters {
  uint64_t batches = 0;
  uint64_t ns_in_collectives = 0;
  uint64_t ns_total = 0;
};

class KeyExchange {
 public:
  KeyExchange(MPI_Comm comm, std::string channel, bool allocate)
      : comm_(comm), channel_(std::move(channel)), allocate_(allocate) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &world_);
  }

  int rank() const { return rank_; }
  int world() const { return world_; }
  const std::string& channel() const { return channel_; }
  ExchangeCounters counters() const { return counters_; }

  // Returns false when some rank has no more data: every rank returns false at the same batch.
  bool run(const std::vector<FeatureInput>& in, bool has_data, std::vector<FeatureOutput>& out) {
    const auto t0 = std::chrono::steady_clock::now();
    uint64_t coll_ns = 0;
    const size_t nf = in.size();
    out.assign(nf, FeatureOutput{});
    // Per feature: unique keys bucketed by owner, and each unique key's place in the send layout.
    std::vector<std::vector<int64_t>> unique(nf);
    std::vector<std::vector<int32_t>> counts(nf, std::vector<int32_t>(world_, 0));
    std::vector<std::vector<int32_t>> place(nf);
    std::vector<std::vector<int32_t>> owners(nf);
    int64_t status[4] = {has_data ? 1 : 0, -1, 0, 0};  // has data, overflowing feature, its bucket, owner
    if (has_data) {
      for (size_t f = 0; f < nf; ++f) {
        out[f].restore.resize(in[f].n);
        if (in[f].keys_are_int32)
          dedup_.run(static_cast<const int32_t*>(in[f].keys), in[f].n, unique[f], out[f].restore.data());
        else
          dedup_.run(static_cast<const int64_t*>(in[f].keys), in[f].n, unique[f], out[f].restore.data());
        place[f].resize(unique[f].size());
        owners[f].resize(unique[f].size());
        for (size_t u = 0; u < unique[f].size(); ++u) {
          owners[f][u] = owner_of(unique[f][u], world_);
          place[f][u] = counts[f][owners[f][u]]++;
        }
        for (int r = 0; r < world_; ++r) {
          if (in[f].send_count > 0 && counts[f][r] > in[f].send_count && status[1] < 0) {
            status[1] = static_cast<int64_t>(f);
            status[2] = counts[f][r];
            status[3] = r;
          }
        }
      }
    }

    // 1. Status of every rank.
    std::vector<int64_t> all_status(4 * static_cast<size_t>(world_));
    coll_ns += timed([&] { MPI_Allgather(status, 4, MPI_INT64_T, all_status.data(), 4, MPI_INT64_T, comm_); });
    for (int r = 0; r < world_; ++r) {
      if (all_status[4 * r] == 0) {
        finish(t0, coll_ns);
        return false;
      }
    }
    std::string overflow;
    for (int r = 0; r < world_; ++r) {
      const int64_t* s = &all_status[4 * r];
      if (s[1] < 0) continue;
      const auto& f = in[static_cast<size_t>(s[1])];
      overflow += (overflow.empty() ? "" : "; ") + std::string("table '") + f.index->name() + "': rank " +
                  std::to_string(r) + " has " + std::to_string(s[2]) + " unique keys for rank " +
                  std::to_string(s[3]) + ", more than send_count=" + std::to_string(f.send_count);
    }
    if (!overflow.empty())
      throw ExchangeError(overflow + "; raise send_count to at least the largest of these (every rank stops here)");

    // 2. Bucket sizes, laid out [peer][feature].
    std::vector<int32_t> send_counts(static_cast<size_t>(world_) * nf), recv_counts(send_counts.size());
    for (int r = 0; r < world_; ++r)
      for (size_t f = 0; f < nf; ++f) send_counts[r * nf + f] = counts[f][r];
    coll_ns += timed([&] {
      MPI_Alltoall(send_counts.data(), static_cast<int>(nf), MPI_INT32_T, recv_counts.data(), static_cast<int>(nf),
                   MPI_INT32_T, comm_);
    });

    // 3. The keys: for each peer, each feature's bucket, unpadded (padding never travels).
    std::vector<int> sdispl(world_ + 1, 0), rdispl(world_ + 1, 0), scount(world_), rcount(world_);
    for (int r = 0; r < world_; ++r) {
      scount[r] = rcount[r] = 0;
      for (size_t f = 0; f < nf; ++f) {
        scount[r] += send_counts[r * nf + f];
        rcount[r] += recv_counts[r * nf + f];
      }
      sdispl[r + 1] = sdispl[r] + scount[r];
      rdispl[r + 1] = rdispl[r] + rcount[r];
    }
    send_buf_.resize(static_cast<size_t>(sdispl[world_]));
    recv_buf_.resize(static_cast<size_t>(rdispl[world_]));
    for (size_t f = 0; f < nf; ++f) {
      std::vector<int> base(sdispl.begin(), sdispl.end() - 1);
      for (int r = 0; r < world_; ++r)
        for (size_t g = 0; g < f; ++g) base[r] += counts[g][r];
      for (size_t u = 0; u < unique[f].size(); ++u) send_buf_[base[owners[f][u]] + place[f][u]] = unique[f][u];
    }
    coll_ns += timed([&] {
      MPI_Alltoallv(send_buf_.data(), scount.data(), sdispl.data(), MPI_INT64_T, recv_buf_.data(), rcount.data(),
                    rdispl.data(), MPI_INT64_T, comm_);
    });

    // Owner side: received keys -> local rows, per feature in source-rank order; requester side:
    // restore indices into the rows that come back, laid out by owner rank.
    for (size_t f = 0; f < nf; ++f) {
      FeatureOutput& o = out[f];
      const int64_t pad = in[f].send_count;
      o.send_splits.resize(world_);
      o.recv_splits.resize(world_);
      size_t total_recv = 0;
      for (int s = 0; s < world_; ++s) {
        o.recv_splits[s] = pad > 0 ? static_cast<int32_t>(pad) : recv_counts[s * nf + f];
        o.send_splits[s] = pad > 0 ? static_cast<int32_t>(pad) : counts[f][s];
        total_recv += o.recv_splits[s];
      }
      o.local_slots.assign(total_recv, in[f].index->sentinel());
      size_t dst = 0;
      for (int s = 0; s < world_; ++s) {
        size_t offset = rdispl[s];
        for (size_t g = 0; g < f; ++g) offset += recv_counts[s * nf + g];
        const int32_t n = recv_counts[s * nf + f];
        in[f].index->lookup(recv_buf_.data() + offset, static_cast<size_t>(n), allocate_, o.local_slots.data() + dst);
        in[f].index->add_traffic(counts[f][s], n);
        dst += o.recv_splits[s];
      }
      // Distinct rows on the owner, so the optimizer needs no dedup of its own. With one rank and
      // no padding the received keys are this batch's unique keys already: no expand needed.
      if (world_ > 1 || pad > 0) {
        o.expand.resize(o.local_slots.size());
        owner_dedup_.run(o.local_slots.data(), o.local_slots.size(), owner_unique_, o.expand.data());
        o.local_slots.assign(owner_unique_.begin(), owner_unique_.end());
      }
      std::vector<int32_t> owner_base(world_ + 1, 0);
      for (int r = 0; r < world_; ++r) owner_base[r + 1] = owner_base[r] + o.send_splits[r];
      std::vector<int32_t> back(unique[f].size());
      for (size_t u = 0; u < unique[f].size(); ++u) back[u] = owner_base[owners[f][u]] + place[f][u];
      for (auto& r : o.restore) r = back[r];
    }
    finish(t0, coll_ns);
    return true;
  }

 private:
  template <typename F>
  static uint64_t timed(F&& f) {
    const auto t = std::chrono::steady_clock::now();
    f();
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t).count());
  }

  void finish(std::chrono::steady_clock::time_point t0, uint64_t coll_ns) {
    counters_.batches += 1;
    counters_.ns_in_collectives += coll_ns;
    counters_.ns_total += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  }

  MPI_Comm comm_;
  std::string channel_;
  bool allocate_;
  int rank_ = 0;
  int world_ = 1;
  BatchDedup dedup_, owner_dedup_;
  std::vector<int64_t> send_buf_, recv_buf_, owner_unique_;
  ExchangeCounters counters_;
};

}  // namespace shardrec
