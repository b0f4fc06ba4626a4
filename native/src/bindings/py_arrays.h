// What every binding of the native module shares: numpy arrays in and out (C-ordered arrays, copies
// and hand-overs without a copy) and the checks of values that come from Python. The binding
// headers are included once, by module.cpp: the bindings are one translation unit.
#pragma once

#include <mpi4py/mpi4py.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "exchange/channel.h"
#include "exchange/key_exchange.h"
#include "index/batch_dedup.h"
#include "index/embedding_index.h"
#include "index/index_state.h"

namespace py = pybind11;
using shardrec::BatchDedup;
using shardrec::Channel;
using shardrec::EmbeddingIndex;
using shardrec::ExchangeCounters;
using shardrec::FeatureSet;
using shardrec::IndexCounters;
using shardrec::TierCounters;
using shardrec::KeyExchange;
using shardrec::RowStore;

namespace {

template <typename T>
using CArray = py::array_t<T, py::array::c_style>;

template <typename T>
py::array_t<T> to_numpy(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

// A vector handed over to numpy without a copy: a checkpoint's rows may be most of the memory.
template <typename T, typename Alloc>
py::array_t<T> hand_over(std::vector<T, Alloc>&& v, std::vector<py::ssize_t> shape = {}) {
  if (shape.empty()) shape = {static_cast<py::ssize_t>(v.size())};
  auto* owned = new std::vector<T, Alloc>(std::move(v));
  py::capsule release(owned, [](void* p) { delete static_cast<std::vector<T, Alloc>*>(p); });
  return py::array_t<T>(shape, owned->data(), release);
}

// A channel from Python: pybind11 makes an enum from any int (and rank_runtime passes its IntEnum),
// so the value is checked before it indexes anything.
Channel checked(Channel c) {
  if (c != Channel::kTrain && c != Channel::kEval)
    throw std::invalid_argument("channel must be Channel.TRAIN (0) or Channel.EVAL (1), got " +
                                std::to_string(static_cast<int>(c)));
  return c;
}

// The common length of three arrays that go together, or an error naming them.
size_t same_length(const py::array& a, const py::array& b, const py::array& c, const char* names) {
  if (a.size() != b.size() || a.size() != c.size())
    throw std::invalid_argument(std::string(names) + " must have the same length");
  return static_cast<size_t>(a.size());
}

}  // namespace
