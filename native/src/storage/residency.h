// Which rows of a table shard's memory tier may move down to its SSD tier, and which go first.
//
// Pins: the key pipeline looks batches up ahead of training, and a kernel reads and updates a
// batch's rows by their row number, so no row of a batch looked up and not yet trained may move.
// Each lookup is one batch of a channel (channel.h) with a ticket (1, 2, ...); a row keeps
// the ticket of the last batch of each channel that used it, and the op library's row gather
// reports the ticket of each batch it reads (RowStore::note_gathered). Batch t of a channel is done
// once batch t+1 of it is read (the session ran t's step, gathers and updates, before), so a row
// is pinned while any channel's last ticket on it is >= the last ticket read on that channel.
//
// Coldness, to choose among unpinned rows: least recently used (the batch clock of the last use)
// or least frequently used (batches that used the row, the recency breaking ties); the benchmark
// (bench/sparse_step.py --tiers) measures both on Zipf keys.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "exchange/channel.h"

namespace shardrec {

enum class SwapPolicy : int32_t { kLru = 0, kLfu = 1 };

class Residency {
 public:
  void resize(size_t rows) {
    for (auto& p : pin_) p.assign(rows, 0);
    last_use_.assign(rows, 0);
    uses_.assign(rows, 0);
  }
  void set_policy(SwapPolicy p) { policy_ = p; }
  SwapPolicy policy() const { return policy_; }

  // A new batch of `channel`: its ticket.
  uint32_t begin_batch(Channel channel) {
    ++clock_;
    return ++ticket_[index_of(channel)];
  }
  uint32_t ticket(Channel channel) const { return ticket_[index_of(channel)]; }

  // Row `s` is used by the current batch of `channel`; `uses` carries its count over a swap.
  void touch(int32_t s, Channel channel) {
    pin_[index_of(channel)][s] = ticket_[index_of(channel)];
    last_use_[s] = clock_;
    if (uses_[s] != UINT32_MAX) ++uses_[s];
  }
  void arrive(int32_t s, uint32_t uses) {
    uses_[s] = uses;
    pin_[0][s] = pin_[1][s] = 0;
  }
  uint32_t uses(int32_t s) const { return uses_[s]; }

  bool pinned(int32_t s, const uint32_t gathered[kChannels]) const {
    for (int c = 0; c < kChannels; ++c)
      if (pin_[c][s] != 0 && pin_[c][s] >= gathered[c]) return true;
    return false;
  }

  // Up to `most` of the coldest unpinned rows among [0, n) that hold a key (into `out`); returns
  // how many were unpinned.
  template <typename Holds>
  size_t coldest(int32_t n, Holds holds, size_t most, const uint32_t gathered[kChannels], std::vector<int32_t>& out) {
    scored_.clear();
    for (int32_t s = 0; s < n; ++s)
      if (holds(s) && !pinned(s, gathered)) scored_.emplace_back(score(s), s);
    const size_t k = std::min(most, scored_.size());
    std::nth_element(scored_.begin(), scored_.begin() + static_cast<std::ptrdiff_t>(k), scored_.end());
    out.clear();
    for (size_t i = 0; i < k; ++i) out.push_back(scored_[i].second);
    return scored_.size();
  }

 private:
  uint64_t score(int32_t s) const {
    return policy_ == SwapPolicy::kLru ? last_use_[s] : (static_cast<uint64_t>(uses_[s]) << 32) | last_use_[s];
  }

  SwapPolicy policy_ = SwapPolicy::kLfu;
  uint32_t ticket_[kChannels] = {0, 0};
  uint32_t clock_ = 0;
  std::vector<uint32_t> pin_[kChannels];
  std::vector<uint32_t> last_use_, uses_;
  std::vector<std::pair<uint64_t, int32_t>> scored_;
};

}  // namespace shardrec
