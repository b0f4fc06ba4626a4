// Bindings of the values that cross to Python (counters, an index's state, a batch's routing),
// batch dedup and ownership, and the native errors as Python exceptions.
#pragma once

#include "bindings/py_arrays.h"

namespace {

// ---- counters: read-only fields listed once in index_state.h, and a dict for JSON and logs.
#define SHARDREC_READONLY(type, name, doc) cls.def_readonly(#name, &Counters::name, doc);
#define SHARDREC_DICT_ITEM(type, name, doc) d[#name] = c.name;
#define SHARDREC_BIND_COUNTERS(var, Type, FIELDS, doc_text)            \
  py::class_<Type> var(m, #Type, doc_text);                            \
  {                                                                    \
    using Counters = Type;                                             \
    auto& cls = var;                                                   \
    FIELDS(SHARDREC_READONLY)                                          \
    cls.def("as_dict", [](const Counters& c) {                         \
      py::dict d;                                                      \
      FIELDS(SHARDREC_DICT_ITEM)                                       \
      return d;                                                        \
    });                                                                \
    cls.def("__repr__", [](const Counters& c) {                        \
      py::dict d;                                                      \
      FIELDS(SHARDREC_DICT_ITEM)                                       \
      return std::string(#Type) + py::repr(d).cast<std::string>();     \
    });                                                                \
  }

void bind_values(py::module_& m) {
  py::enum_<Channel>(m, "Channel", py::arithmetic(), "The key pipeline's channels (channel.h).")
      .value("TRAIN", Channel::kTrain)
      .value("EVAL", Channel::kEval);
  // rank_runtime/formats/channel.py's Channel (an IntEnum with the same values) is accepted wherever this one is.
  py::implicitly_convertible<py::int_, Channel>();

  SHARDREC_BIND_COUNTERS(index_counters, IndexCounters, SHARDREC_INDEX_COUNTERS, "A table shard's key counters.")
  SHARDREC_BIND_COUNTERS(tier_counters, TierCounters, SHARDREC_TIER_COUNTERS, "A table shard's SSD tier counters.")
  SHARDREC_BIND_COUNTERS(exchange_counters, ExchangeCounters, SHARDREC_EXCHANGE_COUNTERS,
                         "A key exchange channel's counters.")
  exchange_counters
      .def_property_readonly("seconds_in_collectives",
                             [](const ExchangeCounters& c) { return c.ns_in_collectives * 1e-9; })
      .def_property_readonly("seconds_total", [](const ExchangeCounters& c) { return c.ns_total * 1e-9; })
      .def_property_readonly("seconds_cpu", [](const ExchangeCounters& c) { return c.ns_cpu * 1e-9; });

  py::class_<shardrec::StoreBytes>(m, "StoreBytes", "Bytes of a row store's rows in use.")
      .def_readonly("values", &shardrec::StoreBytes::values)
      .def_readonly("slots", &shardrec::StoreBytes::slots, "the optimizer slot columns")
      .def_readonly("metadata", &shardrec::StoreBytes::metadata);

  py::class_<shardrec::PendingKeys>(m, "PendingKeys", "Keys counting towards admission, with no row yet.")
      .def_property_readonly("keys", [](const shardrec::PendingKeys& p) { return to_numpy(p.keys); })
      .def_property_readonly("counts", [](const shardrec::PendingKeys& p) { return to_numpy(p.counts); })
      .def_property_readonly("last_seen", [](const shardrec::PendingKeys& p) { return to_numpy(p.last_seen); });

  py::class_<shardrec::IndexState>(m, "IndexState",
                                   "An index's keys as a checkpoint sees them: each key with its row (row order); "
                                   "as of a step, with the admission state.")
      .def_property_readonly("keys", [](const shardrec::IndexState& s) { return to_numpy(s.keys); })
      .def_property_readonly("rows", [](const shardrec::IndexState& s) { return to_numpy(s.rows); })
      .def_property_readonly("counts", [](const shardrec::IndexState& s) { return to_numpy(s.counts); })
      .def_property_readonly("last_seen", [](const shardrec::IndexState& s) { return to_numpy(s.last_seen); })
      .def_readonly("pending", &shardrec::IndexState::pending)
      .def_property_readonly("removed", [](const shardrec::IndexState& s) { return to_numpy(s.removed); },
                             "a delta save's keys removed (evicted, erased) since the previous save")
      .def_readonly("newest", &shardrec::IndexState::newest, "the newest data timestamp (-1: none)")
      .def_readonly("exact", &shardrec::IndexState::exact, "False: the journal no longer reached back to the step");
}

// One feature's routing as Python sees it: the native vectors handed over to numpy, not copied
// (the key pipeline files them into the dataset element once per batch).
struct PoolArrays {
  py::array_t<int32_t> occ_rows, occ_segments, partial_send_splits, occ_recv_splits, partial_recv_splits,
      partial_index, partial_examples, occ_order, occ_send_splits;

  explicit PoolArrays(shardrec::PoolRouting&& p)
      : occ_rows(hand_over(std::move(p.occ_rows))),
        occ_segments(hand_over(std::move(p.occ_segments))),
        partial_send_splits(hand_over(std::move(p.partial_send_splits))),
        occ_recv_splits(hand_over(std::move(p.occ_recv_splits))),
        partial_recv_splits(hand_over(std::move(p.partial_recv_splits))),
        partial_index(hand_over(std::move(p.partial_index))),
        partial_examples(hand_over(std::move(p.partial_examples))),
        occ_order(hand_over(std::move(p.occ_order))),
        occ_send_splits(hand_over(std::move(p.occ_send_splits))) {}
};

struct RoutingArrays {
  py::array_t<int32_t> rows, expand, send_splits, recv_splits, restore, ticket;
  PoolArrays pool;

  explicit RoutingArrays(shardrec::FeatureRouting&& r)
      : rows(hand_over(std::move(r.rows))),
        expand(hand_over(std::move(r.expand))),
        send_splits(hand_over(std::move(r.send_splits))),
        recv_splits(hand_over(std::move(r.recv_splits))),
        restore(hand_over(std::move(r.restore))),
        ticket(hand_over(shardrec::RoutingVector{r.ticket})),
        pool(std::move(r.pool)) {}
};

void bind_routing(py::module_& m) {
  py::class_<RoutingArrays>(m, "FeatureRouting",
                            "One feature's exchange result for one batch (key_exchange.h, rank_runtime/pipeline/routing.py).")
      .def_readonly("rows", &RoutingArrays::rows, "The distinct local rows this rank gathers for its requesters.")
      .def_readonly("expand", &RoutingArrays::expand, "Per received key, its row among `rows` (empty: identity).")
      .def_readonly("send_splits", &RoutingArrays::send_splits, "Rows going out to each requester.")
      .def_readonly("recv_splits", &RoutingArrays::recv_splits, "Rows coming back from each owner.")
      .def_readonly("restore", &RoutingArrays::restore, "Per id of the batch: its row among those that come back.")
      .def_readonly("ticket", &RoutingArrays::ticket, "[1]: the batch's ticket on the feature's table.")
      .def_readonly("pool", &RoutingArrays::pool, "A pooled feature's partials (pooling.h); empty arrays otherwise.");
  py::class_<PoolArrays>(m, "PoolRouting", "A pooled feature's routing for one batch (exchange/pooling.h).")
      .def_readonly("occ_rows", &PoolArrays::occ_rows, "Owner: per id received, its row among `rows`.")
      .def_readonly("occ_segments", &PoolArrays::occ_segments, "Owner: per id received, the partial it adds to.")
      .def_readonly("partial_send_splits", &PoolArrays::partial_send_splits, "Owner: partials to each requester.")
      .def_readonly("occ_recv_splits", &PoolArrays::occ_recv_splits, "Owner: ids received from each requester.")
      .def_readonly("partial_recv_splits", &PoolArrays::partial_recv_splits, "Requester: partials from each owner.")
      .def_readonly("partial_index", &PoolArrays::partial_index,
                    "Requester: per (example, owner) pair, the partial it reads (empty: the identity).")
      .def_readonly("partial_examples", &PoolArrays::partial_examples, "Requester: per (example, owner) pair, its example.")
      .def_readonly("occ_order", &PoolArrays::occ_order, "Requester: per id sent, its index in the batch.")
      .def_readonly("occ_send_splits", &PoolArrays::occ_send_splits, "Requester: ids sent to each owner.");
}

// ---- batch dedup and ownership
template <typename Key>
py::tuple dedup(CArray<Key> keys) {
  const size_t n = static_cast<size_t>(keys.size());
  py::array_t<int32_t> restore(static_cast<py::ssize_t>(n));
  std::vector<int64_t> unique;
  {
    py::gil_scoped_release nogil;
    BatchDedup d;
    d.run(keys.data(), n, unique, restore.mutable_data());
  }
  return py::make_tuple(to_numpy(unique), restore);
}

int checked_world(int world) {
  if (world < 1) throw py::value_error("world_size must be at least 1, got " + std::to_string(world));
  return world;
}

void bind_functions(py::module_& m) {
  m.def("dedup", &dedup<int64_t>, py::arg("keys"));
  m.def("dedup", &dedup<int32_t>, py::arg("keys"),
        "Unique keys in first-seen order and restore indices (unique[restore] == keys).");
  m.def("owner_of", [](int64_t key, int world) { return shardrec::owner_of(key, checked_world(world)); },
        py::arg("key"), py::arg("world_size"), "The rank that owns `key`: key mod world_size, in [0, world_size).");
  m.def("owners_of",
        [](const CArray<int64_t>& keys, int world) {
          checked_world(world);
          py::array_t<int32_t> owners(keys.size());
          py::gil_scoped_release nogil;
          shardrec::owners_of(keys.data(), static_cast<size_t>(keys.size()), world, owners.mutable_data());
          return owners;
        },
        py::arg("keys"), py::arg("world_size"),
        "owner_of for every key of a flat int64 array, as the key exchange routes them (int32 ranks).");
}

void bind_errors(py::module_& m) {
  py::register_exception<shardrec::CapacityError>(m, "CapacityError", PyExc_RuntimeError);
  py::register_exception<shardrec::TierDamagedError>(m, "TierDamagedError", PyExc_RuntimeError);
  auto exchange_error = py::register_exception<shardrec::ExchangeError>(m, "ExchangeError", PyExc_RuntimeError);
  py::register_exception<shardrec::ExchangeTimeout>(m, "ExchangeTimeout", exchange_error.ptr());
  auto pass_closed = py::register_exception<shardrec::PassClosedError>(m, "PassClosedError", PyExc_RuntimeError);
  py::register_exception<shardrec::PeerClosedError>(m, "PeerClosedError", pass_closed.ptr());
  // A checkpoint file that cannot be written is an OSError with its errno, as Python's own I/O.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const shardrec::FileError& e) {
      py::object error = py::module_::import("builtins").attr("OSError")(e.code().value(), e.what());
      PyErr_SetObject(PyExc_OSError, error.ptr());
    }
  });
}

}  // namespace
