// Routing of one batch's keys, all features at once: dedup each feature's ids, bucket the unique
// ids by owner rank (key mod world size, the same rule for negative keys everywhere), and move
// the buckets to their owners with two collectives (bucket sizes, then the keys, unpadded). Plain
// MPI on int64 buckets: what the owners do with the keys is key_exchange.h's business.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "batch_dedup.h"
#include "channel_comm.h"

namespace shardrec {

inline int owner_of(int64_t key, int world) {
  const int64_t r = key % world;
  return static_cast<int>(r < 0 ? r + world : r);
}

struct RouterInput {
  const void* keys;
  bool keys_are_int32;
  size_t n;
};

class KeyRouter {
 public:
  // Dedups and buckets every feature; restore[f][i] is id i's index among feature f's unique ids.
  void bucket(const std::vector<RouterInput>& in, int world, std::vector<std::vector<int32_t>>& restore) {
    nf_ = in.size();
    world_ = world;
    unique_.resize(nf_);
    owner_.resize(nf_);
    place_.resize(nf_);
    counts_.assign(nf_, std::vector<int32_t>(world_, 0));
    restore.resize(nf_);
    for (size_t f = 0; f < nf_; ++f) {
      restore[f].resize(in[f].n);
      if (in[f].keys_are_int32)
        dedup_.run(static_cast<const int32_t*>(in[f].keys), in[f].n, unique_[f], restore[f].data());
      else
        dedup_.run(static_cast<const int64_t*>(in[f].keys), in[f].n, unique_[f], restore[f].data());
      owner_[f].resize(unique_[f].size());
      place_[f].resize(unique_[f].size());
      for (size_t u = 0; u < unique_[f].size(); ++u) {
        owner_[f][u] = owner_of(unique_[f][u], world_);
        place_[f][u] = counts_[f][owner_[f][u]]++;
      }
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
      for (size_t u = 0; u < unique_[f].size(); ++u) send_buf_[base[owner_[f][u]] + place_[f][u]] = unique_[f][u];
      for (size_t r = 0; r < w; ++r) base[r] += counts_[f][r];
    }
    comm.alltoallv(send_buf_.data(), scount.data(), sdispl.data(), recv_buf_.data(), rcount.data(), rdispl_.data(),
                   "keys");
  }

  size_t features() const { return nf_; }
  const std::vector<int64_t>& unique(size_t f) const { return unique_[f]; }
  // Unique keys of feature f this rank sends to `owner`.
  int32_t sent(size_t f, int owner) const { return counts_[f][owner]; }
  int32_t received_count(size_t f, int source) const { return recv_counts_[source * nf_ + f]; }
  const int64_t* received(size_t f, int source) const {
    size_t offset = rdispl_[source];
    for (size_t g = 0; g < f; ++g) offset += recv_counts_[source * nf_ + g];
    return recv_buf_.data() + offset;
  }
  // Where unique key u of feature f sits among what `owner_of(u)` returns: owner and position.
  int owner(size_t f, size_t u) const { return owner_[f][u]; }
  int32_t place(size_t f, size_t u) const { return place_[f][u]; }

 private:
  size_t nf_ = 0;
  int world_ = 1;
  BatchDedup dedup_;
  std::vector<std::vector<int64_t>> unique_;
  std::vector<std::vector<int32_t>> owner_, place_, counts_;
  std::vector<int32_t> recv_counts_;
  std::vector<int> rdispl_;
  std::vector<int64_t> send_buf_, recv_buf_;
};

}  // namespace shardrec
