// The two channels of the key pipeline: training batches (they allocate rows, count towards
// admission, evict) and evaluation batches (they look rows up and change nothing). One enum for
// every layer: the exchange, the index's tickets, the row store's gathered batches; pybind11 gives
// it to Python as shardrec.native.core.Channel, and TensorFlow op attributes carry its int value.
#pragma once

#include <cstdint>

namespace shardrec {

enum class Channel : int32_t { kTrain = 0, kEval = 1 };
constexpr int kChannels = 2;

inline int index_of(Channel c) { return static_cast<int>(c); }
inline const char* name_of(Channel c) { return c == Channel::kTrain ? "train" : "eval"; }

}  // namespace shardrec
