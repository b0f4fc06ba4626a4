// Pooling on the owner, for variable-length (multi-hot) features: the routing that lets the owner
// of a key add up, per example, the rows it holds for that example, so that one partial vector per
// (example, owner) crosses the network instead of one row per id; the requester adds the partials
// of an example (rank_runtime/pipeline/pooled.py does the arithmetic in the graph).
//
// The requester knows, per id, its example, its owner and its key's place among what it sent that
// owner (the key exchange decided those). It sends each owner, in one more collective of the key
// round, how many ids each partial going back adds up and each id's place (ordered by owner, then
// example: 4 bytes an id and 4 a partial); the owner turns places into rows of its shard. A repeated id in one
// example is two words, and adds twice, as in tf.nn.embedding_lookup_sparse.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "storage/aligned_vector.h"
#include "exchange/channel_comm.h"
#include "exchange/key_router.h"

namespace shardrec {

// One pooled feature's routing for one batch. Owner side: the ids it received and where they go.
// Requester side: what it sent and what comes back.
struct PoolRouting {
  RoutingVector occ_rows;             // owner: per id received, its row among the feature's `rows`
  RoutingVector occ_segments;         // owner: per id received, the partial it adds to (nondecreasing)
  RoutingVector partial_send_splits;  // owner: partials going back to each requester
  RoutingVector occ_recv_splits;      // owner: ids received from each requester (their weights, too)
  RoutingVector partial_recv_splits;  // requester: partials coming back from each owner
  RoutingVector partial_index;        // requester: per (example, owner) pair, the partial it reads (empty: the
                                      // identity; shared singletons, see PoolInput::share_singletons)
  RoutingVector partial_examples;     // requester: per (example, owner) pair, its example
  RoutingVector occ_order;            // requester: per id sent (owner order), its index in the batch
  RoutingVector occ_send_splits;      // requester: ids sent to each owner
};

// A pooled feature's input: its ids' examples as row splits (ragged row_splits: example b holds
// ids [splits[b], splits[b + 1])), and, per id, its owner and its key's place among those that
// owner returns (from the key router).
struct PoolInput {
  const int64_t* splits;
  size_t examples;
  // An (example, owner) pair of one id is that id's row, which every example holding just that id
  // on that owner can share (a lookup without weights): it crosses once, as a padded lookup's
  // deduplicated row would, and the requester reads it once per example.
  bool share_singletons;
  std::vector<int32_t> owner, place;
  // Owner side: `rows` index of each received key (empty: the identity), where each requester's
  // keys start among those received, and how many it sent.
  const RoutingVector* expand;
  std::vector<int32_t> received_base, received;
  // A column-wise table's slice ranks from owner[i] on: each gets the same ids and places and
  // pools its own columns; the requester joins their partials side by side (pooled_lookup.py).
  int first = 0, slices = 1;
};

// A pooled feature's input from the key round: per id, its owner (key mod world) and its place
// among what that owner returns (`restore` is the index among all returned rows, laid out by
// owner with `recv_splits` each); the owner's view from what it received.
template <typename Key>
PoolInput pool_input(const Key* keys, const int64_t* splits, size_t examples, bool share_singletons,
                     const RoutingVector& restore, const RoutingVector& recv_splits, const RoutingVector& send_splits,
                     const RoutingVector& expand, std::vector<int32_t> received, int placement = kRowWise,
                     int slices = 1) {
  // placement: a table-wise table's rank owns every id (a column-wise table's first slice rank: the
  // slices after it get copies); row-wise: key mod world (never kReplicated: a replicated table's
  // ids are pooled by the requester).
  const size_t w = recv_splits.size(), n = restore.size();
  PoolInput in{splits, examples, share_singletons, std::vector<int32_t>(n), std::vector<int32_t>(n), &expand,
               std::vector<int32_t>(w, 0), std::move(received), std::max(placement, 0),
               placement >= 0 ? slices : 1};
  std::vector<int32_t> back_base(w, 0);
  for (size_t r = 1; r < w; ++r) {
    back_base[r] = back_base[r - 1] + recv_splits[r - 1];
    in.received_base[r] = in.received_base[r - 1] + send_splits[r - 1];
  }
  for (size_t i = 0; i < n; ++i) {
    in.owner[i] = placement >= 0 ? placement : owner_of(static_cast<int64_t>(keys[i]), static_cast<int>(w));
    in.place[i] = restore[i] - back_base[in.owner[i]];
  }
  return in;
}

class KeyPooler {
 public:
  // Bytes the last run sent to other ranks.
  uint64_t bytes_sent() const { return bytes_sent_; }

  // Requester side of every pooled feature, then one exchange for all of them, then the owner's
  // side: places resolved into rows. What goes to an owner, per feature: the length of each
  // partial, then each id's place (int32 each: 4 bytes an id and 4 a partial).
  void run(ChannelComm& comm, const std::vector<PoolInput>& in, std::vector<PoolRouting>& out) {
    const size_t np = in.size(), w = static_cast<size_t>(comm.world());
    out.assign(np, PoolRouting{});
    pairs_.resize(w);
    lengths_.resize(w);
    places_.resize(w);
    order_.resize(w);
    shared_.resize(w);
    std::vector<std::vector<std::vector<int32_t>>> blocks(np);  // [feature][owner]: lengths, then places
    for (size_t p = 0; p < np; ++p) order(in[p], w, out[p], blocks[p]);
    std::vector<int32_t> send_counts(w * np * 2), recv_counts(w * np * 2);  // [peer][feature][ids, partials]
    for (size_t r = 0; r < w; ++r)
      for (size_t p = 0; p < np; ++p) {
        send_counts[(r * np + p) * 2] = out[p].occ_send_splits[r];
        send_counts[(r * np + p) * 2 + 1] = out[p].partial_recv_splits[r];
      }
    comm.alltoall(send_counts.data(), recv_counts.data(), static_cast<int>(np * 2), "pooling sizes");
    std::vector<int> scount(w, 0), rcount(w, 0), sdispl(w + 1, 0), rdispl(w + 1, 0);
    for (size_t r = 0; r < w; ++r) {
      for (size_t p = 0; p < np; ++p) {
        scount[r] += send_counts[(r * np + p) * 2] + send_counts[(r * np + p) * 2 + 1];
        rcount[r] += recv_counts[(r * np + p) * 2] + recv_counts[(r * np + p) * 2 + 1];
      }
      sdispl[r + 1] = sdispl[r] + scount[r];
      rdispl[r + 1] = rdispl[r] + rcount[r];
    }
    send_.resize(static_cast<size_t>(sdispl[w]));
    recv_.resize(static_cast<size_t>(rdispl[w]));
    for (size_t r = 0; r < w; ++r) {
      int32_t* at = send_.data() + sdispl[r];
      for (size_t p = 0; p < np; ++p) at = std::copy(blocks[p][r].begin(), blocks[p][r].end(), at);
    }
    comm.alltoallv(send_.data(), scount.data(), sdispl.data(), recv_.data(), rcount.data(), rdispl.data(),
                   "pooling ids");
    bytes_sent_ = static_cast<uint64_t>(sdispl[w] - scount[static_cast<size_t>(comm.rank())]) * sizeof(int32_t);
    std::vector<int> at(rdispl.begin(), rdispl.end() - 1);
    for (size_t p = 0; p < np; ++p) resolve(p, w, recv_counts, in[p], at, out[p]);
  }

 private:
  // Ids ordered by owner, then example (ragged ids come in example order, so one pass bucketing by
  // owner keeps that order); each (owner, example) pair is one partial, or shares one (singletons).
  void order(const PoolInput& in, size_t w, PoolRouting& o, std::vector<std::vector<int32_t>>& blocks) {
    o.occ_send_splits.assign(w, 0);
    o.partial_recv_splits.assign(w, 0);
    o.occ_order.clear();
    for (size_t r = 0; r < w; ++r) {
      pairs_[r].clear();
      lengths_[r].clear();
      places_[r].clear();
      order_[r].clear();
      shared_[r].clear();
    }
    for (size_t b = 0; b < in.examples; ++b) {
      touched_.clear();
      for (int64_t i = in.splits[b]; i < in.splits[b + 1]; ++i) {
        const int32_t r = in.owner[static_cast<size_t>(i)];
        if (pairs_[r].empty() || pairs_[r].back().second != static_cast<int32_t>(b)) {
          pairs_[r].emplace_back(static_cast<int32_t>(lengths_[r].size()), static_cast<int32_t>(b));
          lengths_[r].push_back(0);
          touched_.push_back(r);
        }
        lengths_[r].back() += 1;
        places_[r].push_back(in.place[static_cast<size_t>(i)]);
        order_[r].push_back(static_cast<int32_t>(i));
      }
      if (!in.share_singletons) continue;
      for (int32_t r : touched_) {  // a singleton seen before reads that partial; this one is dropped
        if (lengths_[r].back() != 1) continue;
        const auto seen = shared_[r].emplace(places_[r].back(), pairs_[r].back().first);
        if (seen.second) continue;
        pairs_[r].back().first = seen.first->second;
        lengths_[r].pop_back();
        places_[r].pop_back();
        order_[r].pop_back();
      }
    }
    o.partial_examples.clear();
    o.partial_index.clear();
    blocks.resize(w);
    int32_t base = 0;
    for (size_t r = 0; r < w; ++r) {
      o.occ_send_splits[r] = static_cast<int32_t>(places_[r].size());
      o.partial_recv_splits[r] = static_cast<int32_t>(lengths_[r].size());
      o.occ_order.insert(o.occ_order.end(), order_[r].begin(), order_[r].end());
      for (const auto& pair : pairs_[r]) {
        if (in.share_singletons) o.partial_index.push_back(base + pair.first);
        o.partial_examples.push_back(pair.second);
      }
      base += o.partial_recv_splits[r];
      blocks[r] = lengths_[r];
      blocks[r].insert(blocks[r].end(), places_[r].begin(), places_[r].end());
    }
    if (in.slices > 1) copy_to_slices(in, o, blocks);
  }

  // A column-wise table: every slice rank after the first gets the first's ids, places and partial
  // lengths, so each returns the same partials of its own columns. The requester reads its partials
  // (partial_index, partial_examples) from the first block once the blocks are joined side by side.
  static void copy_to_slices(const PoolInput& in, PoolRouting& o, std::vector<std::vector<int32_t>>& blocks) {
    const size_t first = static_cast<size_t>(in.first);
    const RoutingVector once(o.occ_order);
    for (size_t r = first + 1; r < first + static_cast<size_t>(in.slices); ++r) {
      blocks[r] = blocks[first];
      o.occ_send_splits[r] = o.occ_send_splits[first];
      o.partial_recv_splits[r] = o.partial_recv_splits[first];
      o.occ_order.insert(o.occ_order.end(), once.begin(), once.end());
    }
  }

  // Owner side: each received id's row and partial. Lengths or places out of range mean the ranks
  // ran different routings, which the key round's checks rule out; they are refused, not read.
  void resolve(size_t p, size_t w, const std::vector<int32_t>& recv_counts, const PoolInput& in, std::vector<int>& at,
               PoolRouting& o) {
    const RoutingVector& expand = *in.expand;
    const size_t np = recv_counts.size() / (2 * w);
    o.occ_recv_splits.assign(w, 0);
    o.partial_send_splits.assign(w, 0);
    o.occ_rows.clear();
    o.occ_segments.clear();
    int32_t partials = 0;
    for (size_t s = 0; s < w; ++s) {
      const int32_t ids = recv_counts[(s * np + p) * 2], parts = recv_counts[(s * np + p) * 2 + 1];
      o.occ_recv_splits[s] = ids;
      o.partial_send_splits[s] = parts;
      const int32_t* lengths = recv_.data() + at[s];
      const int32_t* places = lengths + parts;
      at[s] += parts + ids;
      int64_t total = 0;
      for (int32_t j = 0; j < parts; ++j) total += lengths[j] > 0 ? lengths[j] : ids + 1;
      if (total != ids) throw refused(s, "partials of " + std::to_string(total) + " ids in all", ids);
      for (int32_t j = 0, k = 0; j < parts; ++j) {
        for (int32_t end = k + lengths[j]; k < end; ++k) {
          if (places[k] < 0 || places[k] >= in.received[s])
            throw refused(s, "an id at place " + std::to_string(places[k]), ids);
          const size_t key = static_cast<size_t>(in.received_base[s] + places[k]);
          o.occ_rows.push_back(expand.empty() ? static_cast<int32_t>(key) : expand[key]);
          o.occ_segments.push_back(partials + j);
        }
      }
      partials += parts;
    }
  }

  static ExchangeError refused(size_t source, const std::string& what, int32_t ids) {
    return ExchangeError("pooling: rank " + std::to_string(source) + " sent " + what + " for " + std::to_string(ids) +
                         " ids (the ranks' routings differ; every rank stops here)");
  }

  uint64_t bytes_sent_ = 0;
  // Per owner, reused between batches: (partial, example) pairs, partial lengths, places, batch
  // positions, and the partial of each singleton place.
  std::vector<std::vector<std::pair<int32_t, int32_t>>> pairs_;
  std::vector<std::vector<int32_t>> lengths_, places_, order_;
  std::vector<std::unordered_map<int32_t, int32_t>> shared_;
  std::vector<int32_t> touched_;
  std::vector<int32_t> send_, recv_;
};

}  // namespace shardrec
