// The features of one key round (what every rank must agree on) and one feature's result.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "storage/aligned_vector.h"
#include "exchange/pooling.h"

namespace shardrec {

class EmbeddingIndex;

// What every rank must agree on for the features of one insert function, matched by position
// (the runtime orders features by name, and the signature proves the ranks agree).
struct ExchangeFeature {
  std::string name;
  EmbeddingIndex* index;
  int64_t send_count;  // 0: dynamic shapes; else every bucket is padded to it
  bool int32_keys;     // the table's key dtype is int32: ids must fit in it
  // Variable-length ids pooled on the owner (pooling.h): 0 no, 1 yes, 2 yes, by lookups without
  // weights only (singleton partials shared).
  int pooled = 0;
  // Where the table's keys live: kRowWise (key mod world), kReplicated, or a table-wise rank; a
  // column-wise table is table-wise over `slices` ranks from that one on (key_router.h).
  int placement = kRowWise;
  int slices = 1;
};

inline uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ULL;
  return h;
}

struct FeatureSet {
  FeatureSet(std::vector<ExchangeFeature> f, std::string d, std::string ts = "")
      : features(std::move(f)), description(std::move(d)), signature(static_cast<int64_t>(fnv1a(description))),
        timestamp_feature(std::move(ts)) {}
  std::vector<ExchangeFeature> features;
  std::string description;  // one line per feature; named in the error when ranks differ
  int64_t signature;
  std::string timestamp_feature;  // the is_timestamp feature whose values come with every batch ('' none)
};

// One feature's result for one batch: how the lookup moves its rows (rank_runtime/pipeline/routing.py
// files the same fields, by the same names, into the dataset element).
struct FeatureRouting {
  RoutingVector rows;         // the distinct local rows this rank gathers for its requesters
  RoutingVector expand;       // per received key, its row among `rows` (empty: identity)
  RoutingVector send_splits;  // rows going out to each requester
  RoutingVector recv_splits;  // rows coming back from each owner (what this rank sent it keys for)
  RoutingVector restore;      // per id of the batch: its row among those that come back
  int32_t ticket = 0;                // the batch's ticket on the feature's table (residency.h)
  PoolRouting pool;                  // a pooled feature's partials (pooling.h); empty otherwise
};

}  // namespace shardrec
