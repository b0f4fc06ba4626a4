// Bindings of the key exchange (exchange/key_exchange.h): feature sets and the exchange itself.
#pragma once

#include "bindings/bind_values.h"
#include "bindings/py_arrays.h"

namespace {

// ---- the key exchange
void bind_feature_set(py::module_& m) {
  py::class_<FeatureSet>(m, "FeatureSet")
      .def(py::init([](const std::vector<std::string>& names, const std::vector<EmbeddingIndex*>& indexes,
                       const std::vector<int64_t>& send_counts, const std::vector<bool>& int32_keys,
                       std::string description, std::string timestamp_feature, std::vector<int> pooled,
                       std::vector<int> placements, std::vector<int> slices) {
             const size_t n = names.size();
             if (pooled.empty()) pooled.assign(n, 0);
             if (placements.empty()) placements.assign(n, shardrec::kRowWise);
             if (slices.empty()) slices.assign(n, 1);
             if (indexes.size() != n || send_counts.size() != n || int32_keys.size() != n || pooled.size() != n ||
                 placements.size() != n || slices.size() != n)
               throw std::invalid_argument(
                   "names, indexes, send_counts, int32_keys, pooled, placements and slices need one entry per "
                   "feature");
             std::vector<shardrec::ExchangeFeature> features;
             for (size_t f = 0; f < n; ++f) {
               if (placements[f] < shardrec::kReplicated)
                 throw std::invalid_argument("feature '" + names[f] + "': placement " + std::to_string(placements[f]) +
                                             "; allowed: -1 row-wise, -2 replicated, a rank >= 0 table-wise");
               if (slices[f] < 1 || (slices[f] > 1 && placements[f] < 0))
                 throw std::invalid_argument("feature '" + names[f] + "': " + std::to_string(slices[f]) +
                                             " slices; allowed: 1, or more for a column-wise table (placement >= 0)");
               features.push_back(shardrec::ExchangeFeature{names[f], indexes[f], send_counts[f], int32_keys[f],
                                                            pooled[f], placements[f], slices[f]});
             }
             return new FeatureSet(std::move(features), std::move(description), std::move(timestamp_feature));
           }),
           py::arg("names"), py::arg("indexes"), py::arg("send_counts"), py::arg("int32_keys"), py::arg("description"),
           py::arg("timestamp_feature") = "", py::arg("pooled") = std::vector<int>{},
           py::arg("placements") = std::vector<int>{}, py::arg("slices") = std::vector<int>{},
           py::keep_alive<1, 3>(),
           "The features of one insert function, in the order every rank uses; `description` (a line per "
           "feature) is what the ranks compare. A pooled feature (pooled 1; 2: no lookup of it has weights) "
           "takes its ids as (ids, row_splits). placements: per feature, its table's (-1 row-wise, -2 "
           "replicated, a rank: table-wise); slices: per feature, how many ranks from that one on hold a "
           "column-wise table's columns (1 otherwise).")
      .def_property_readonly("description", [](const FeatureSet& fs) { return fs.description; });
}

// What one batch's exchange gives: whether some rank is out of data (every rank stops the pass at
// this batch) and, per feature, its routing (an empty one, shaped for the batch, at the end).
struct ExchangeResult {
  bool ended = false;
  std::vector<RoutingArrays> features;
};

// The ids of one feature as an array (any array-like is converted), or an error naming the feature.
py::array feature_ids(const FeatureSet& fs, size_t f, py::handle keys) {
  py::array a = py::array::ensure(keys, py::array::c_style);
  if (!a) {
    PyErr_Clear();
    throw py::type_error("feature '" + fs.features[f].name + "': ids must be an int32 or int64 array");
  }
  return a;
}

// A pooled feature's row splits: examples + 1 of them, from 0 to the ids' count, never decreasing.
size_t checked_splits(const FeatureSet& fs, size_t f, py::handle given, size_t ids, CArray<int64_t>& out) {
  out = given.cast<CArray<int64_t>>();
  const int64_t* s = out.data();
  const size_t n = static_cast<size_t>(out.size());
  bool ok = n >= 1 && s[0] == 0 && s[n - 1] == static_cast<int64_t>(ids);
  for (size_t i = 1; ok && i < n; ++i) ok = s[i] >= s[i - 1];
  if (!ok)
    throw std::invalid_argument("feature '" + fs.features[f].name + "': row_splits must start at 0, never decrease "
                                "and end at the number of ids (" + std::to_string(ids) + ")");
  return n - 1;
}

ExchangeResult exchange_run(KeyExchange& ex, const FeatureSet& fs, const py::list& keys, bool has_data,
                            py::object timestamps) {
  const size_t nf = fs.features.size();
  if (static_cast<size_t>(py::len(keys)) != nf)
    throw std::invalid_argument("keys: one id array per feature of the feature set expected");
  shardrec::BatchTimestamps ts;
  CArray<int64_t> ts_array;
  if (has_data && !fs.timestamp_feature.empty()) {
    if (timestamps.is_none())
      throw std::invalid_argument("feature set has is_timestamp feature '" + fs.timestamp_feature +
                                  "': its timestamps must come with every batch");
    ts_array = timestamps.cast<CArray<int64_t>>();
    ts.ts = ts_array.data();
    ts.samples = static_cast<size_t>(ts_array.size());
  }
  std::vector<py::array> arrays;
  std::vector<CArray<int64_t>> splits(nf);
  std::vector<shardrec::RouterInput> in;
  for (size_t f = 0; f < nf; ++f) {
    const bool pooled = fs.features[f].pooled != 0;
    if (pooled && !py::isinstance<py::tuple>(keys[f]))
      throw py::type_error("feature '" + fs.features[f].name + "' is pooled: its ids come as (ids, row_splits)");
    arrays.push_back(feature_ids(fs, f, pooled ? keys[f].cast<py::tuple>()[0] : py::handle(keys[f])));
    if (!has_data) continue;
    const py::array& a = arrays.back();
    const bool i32 = a.dtype().is(py::dtype::of<int32_t>());
    if (!i32 && !a.dtype().is(py::dtype::of<int64_t>()))
      throw py::type_error("feature '" + fs.features[f].name + "': ids must be int32 or int64, got " +
                           std::string(py::str(a.dtype())));
    in.push_back(shardrec::RouterInput{a.data(), i32, static_cast<size_t>(a.size())});
    if (pooled) in.back().examples = checked_splits(fs, f, keys[f].cast<py::tuple>()[1], in.back().n, splits[f]);
    in.back().splits = pooled ? splits[f].data() : nullptr;
  }
  std::vector<shardrec::FeatureRouting> out;
  ExchangeResult result;
  {
    py::gil_scoped_release nogil;
    result.ended = !ex.run(fs, in, has_data, out, ts);
  }
  if (result.ended) {
    out.assign(nf, shardrec::FeatureRouting{});
    for (size_t f = 0; f < nf; ++f) {
      out[f].send_splits.assign(static_cast<size_t>(ex.world()), 0);
      out[f].recv_splits.assign(static_cast<size_t>(ex.world()), 0);
      out[f].restore.assign(static_cast<size_t>(arrays[f].size()), 0);
    }
  }
  for (auto& r : out) result.features.emplace_back(std::move(r));
  return result;
}

void bind_key_exchange(py::module_& m) {
  py::class_<ExchangeResult>(m, "ExchangeResult")
      .def_readonly("ended", &ExchangeResult::ended, "Some rank is out of data: every rank ends the pass here.")
      .def_readonly("features", &ExchangeResult::features, "A FeatureRouting per feature of the feature set.");
  py::class_<KeyExchange>(m, "KeyExchange")
      .def(py::init([](py::object comm, Channel channel, double timeout_s) {
             MPI_Comm* c = PyMPIComm_Get(comm.ptr());
             if (c == nullptr) throw py::error_already_set();
             if (!(timeout_s > 0)) throw std::invalid_argument("timeout_s must be > 0");
             return new KeyExchange(*c, checked(channel), timeout_s);
           }),
           py::arg("comm"), py::arg("channel"), py::arg("timeout_s"), py::keep_alive<1, 2>(),
           "The exchange of `channel` on `comm` (an mpi4py communicator of its own); every round waits at most "
           "timeout_s seconds.")
      .def_property_readonly("rank", &KeyExchange::rank)
      .def_property_readonly("world_size", &KeyExchange::world)
      .def_property_readonly("channel", &KeyExchange::channel)
      .def_property_readonly("ranks_out_of_data", &KeyExchange::ranks_out_of_data,
                             "The ranks whose data ended, after run() said the pass ended.")
      .def_property_readonly("stopped", &KeyExchange::stopped, "The error that stopped this channel ('' if none).")
      .def_property(
          "timeout_s", [](KeyExchange& ex) { return ex.comm().timeout_s(); },
          [](KeyExchange& ex, double s) {
            if (!(s > 0)) throw std::invalid_argument("timeout_s must be > 0");
            ex.comm().set_timeout(s);
          })
      .def(
          "leave",
          [](KeyExchange& ex) {
            py::gil_scoped_release nogil;
            ex.leave();
          },
          "At exit: every peer's pending or next round on this channel sees this rank out of data.")
      .def("close_pass", &KeyExchange::close_pass,
           "A session of this channel closes: no round begins until reopen_pass(), and a peer's round waiting "
           "for this rank's next batch ends (native/src/exchange/pass_closing.h).")
      .def_property_readonly("closing", &KeyExchange::pass_closing,
                             "Whether a session's close holds the channel (close_pass() without reopen_pass() yet).")
      .def("reopen_pass", &KeyExchange::reopen_pass, "Rounds may begin again (the closed session's threads are gone).")
      .def("restart", &KeyExchange::restart,
           "Runs again after an error, unless a round timed out (init() calls it on every rank).")
      .def("run", &exchange_run, py::arg("features"), py::arg("keys"), py::arg("has_data"),
           py::arg("timestamps") = py::none(), "timestamps: the batch's is_timestamp values (int64, one per sample).")
      .def("set_eviction", &KeyExchange::set_eviction, py::arg("step_interval"),
           "Evict every step_interval training steps (0: never).")
      .def("set_step", &KeyExchange::set_step, py::arg("step"),
           "The training step the next batch follows: the global step a session starts or resumes at.")
      .def_property_readonly("step", &KeyExchange::step, "Training steps whose batches were exchanged.")
      .def("request_save", &KeyExchange::request_save, "The next round asks every rank to save (save_schedule.py).")
      .def_property_readonly("save_request_step", &KeyExchange::save_request_step,
                             "The global step whose save the last such round asked for (-1: none).")
      .def_property_readonly("step_follows_training", &KeyExchange::step_follows_training,
                             "Whether set_step numbered the steps from a global step.")
      .def("request_eviction", &KeyExchange::request_eviction, "The next round evicts on every rank.")
      .def("counters", &KeyExchange::counters);
}

}  // namespace
