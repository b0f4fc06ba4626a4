// The pybind11 module: numpy arrays in and out, the GIL released around every loop over keys and
// every MPI call. One binding function per class; what crosses to Python is a typed value with
// read-only fields (counters, an index's state, a batch's routing), never a dict built by hand.
#include <mpi4py/mpi4py.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>

#include "index/batch_dedup.h"
#include "exchange/channel.h"
#include "index/embedding_index.h"
#include "index/index_state.h"
#include "exchange/key_exchange.h"

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
struct RoutingArrays {
  py::array_t<int32_t> rows, expand, send_splits, recv_splits, restore, ticket;

  explicit RoutingArrays(shardrec::FeatureRouting&& r)
      : rows(hand_over(std::move(r.rows))),
        expand(hand_over(std::move(r.expand))),
        send_splits(hand_over(std::move(r.send_splits))),
        recv_splits(hand_over(std::move(r.recv_splits))),
        restore(hand_over(std::move(r.restore))),
        ticket(hand_over(shardrec::RoutingVector{r.ticket})) {}
};

void bind_routing(py::module_& m) {
  py::class_<RoutingArrays>(m, "FeatureRouting",
                            "One feature's exchange result for one batch (key_exchange.h, rank_runtime/pipeline/routing.py).")
      .def_readonly("rows", &RoutingArrays::rows, "The distinct local rows this rank gathers for its requesters.")
      .def_readonly("expand", &RoutingArrays::expand, "Per received key, its row among `rows` (empty: identity).")
      .def_readonly("send_splits", &RoutingArrays::send_splits, "Rows going out to each requester.")
      .def_readonly("recv_splits", &RoutingArrays::recv_splits, "Rows coming back from each owner.")
      .def_readonly("restore", &RoutingArrays::restore, "Per id of the batch: its row among those that come back.")
      .def_readonly("ticket", &RoutingArrays::ticket, "[1]: the batch's ticket on the feature's table.");
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

void bind_functions(py::module_& m) {
  m.def("dedup", &dedup<int64_t>, py::arg("keys"));
  m.def("dedup", &dedup<int32_t>, py::arg("keys"),
        "Unique keys in first-seen order and restore indices (unique[restore] == keys).");
  m.def("owner_of", [](int64_t key, int world) { return shardrec::owner_of(key, world); }, py::arg("key"),
        py::arg("world_size"), "The rank that owns `key`: key mod world_size, in [0, world_size).");
}

// ---- the row store
shardrec::RowInit row_init(int kind, double a, double b, uint64_t seed, double scale) {
  shardrec::RowInit init;
  init.kind = kind;
  init.a = a;
  init.b = b;
  init.seed = seed;
  init.scale = scale;
  return init;
}

std::shared_ptr<RowStore> shared_store(RowStore* s) {
  return std::shared_ptr<RowStore>(s, [](RowStore* p) { p->unref(); });
}

void check_rows_in_use(const RowStore& store, int c, const CArray<int32_t>& rows) {
  if (c < 0 || c >= store.n_columns()) throw std::out_of_range("no column " + std::to_string(c));
  for (int64_t i = 0; i < rows.size(); ++i)
    if (rows.data()[i] < 0 || rows.data()[i] >= store.in_use())
      throw std::out_of_range("row " + std::to_string(rows.data()[i]) + " is not in use");
}

void bind_row_store(py::module_& m) {
  py::class_<RowStore, std::shared_ptr<RowStore>>(m, "RowStore")
      .def(py::init([](const std::string& name, int64_t dim, int64_t rows, int64_t memory_limit, int kind, double a,
                       double b, uint64_t seed, double scale) {
             return shared_store(new RowStore(name, dim, rows, memory_limit, row_init(kind, a, b, seed, scale)));
           }),
           py::arg("name"), py::arg("dim"), py::arg("rows"), py::arg("memory_limit"), py::arg("init_kind"),
           py::arg("init_a"), py::arg("init_b"), py::arg("seed"), py::arg("scale"),
           "A shard's rows: `rows` reserved (the sentinel included), in use a chunk at a time; init_kind 0 "
           "constant a, 1 uniform [a, b), 2 normal (mean a, stddev b), 3 truncated normal; values times scale.")
      .def_property_readonly("address", [](RowStore& s) { return reinterpret_cast<uintptr_t>(&s); })
      .def_property_readonly("dim", &RowStore::dim)
      .def_property_readonly("rows", &RowStore::rows, "Rows reserved, the sentinel included.")
      .def_property_readonly("in_use", &RowStore::in_use)
      .def_property_readonly("n_columns", &RowStore::n_columns)
      .def_property_readonly("chunk_rows", [](const RowStore&) { return RowStore::kChunkRows; })
      .def_property_readonly("bytes_per_row", &RowStore::bytes_per_row,
                             "Bytes of one row in use: values, every slot column, metadata.")
      .def_property_readonly("memory_limit", &RowStore::memory_limit, "Bytes of rows in use at most (0: none).")
      .def("add_column", &RowStore::add_column, py::arg("init"), "An optimizer slot column; returns its number.")
      .def(
          "set_init",
          [](RowStore& s, int kind, double a, double b, uint64_t seed, double scale) {
            s.set_init(row_init(kind, a, b, seed, scale));
          },
          py::arg("init_kind"), py::arg("init_a"), py::arg("init_b"), py::arg("seed"), py::arg("scale"),
          "How rows drawn from now on start (rows taken again after an eviction included).")
      .def("bytes", &RowStore::bytes)
      .def(
          "read_rows",
          [](const RowStore& store, int c, CArray<int32_t> rows) {
            check_rows_in_use(store, c, rows);
            py::array_t<float> out({static_cast<int64_t>(rows.size()), store.dim()});
            py::gil_scoped_release nogil;
            store.read_rows(c, rows.data(), rows.size(), out.mutable_data());
            return out;
          },
          py::arg("column"), py::arg("rows"), "Column `column` of `rows` (every one in use), as [n, dim].")
      .def(
          "write_rows",
          [](RowStore& store, int c, CArray<int32_t> rows, CArray<float> values) {
            check_rows_in_use(store, c, rows);
            if (values.ndim() != 2 || values.shape(0) != rows.size() || values.shape(1) != store.dim())
              throw std::invalid_argument("values must be [len(rows), dim]");
            py::gil_scoped_release nogil;
            store.write_rows(c, rows.data(), rows.size(), values.data());
          },
          py::arg("column"), py::arg("rows"), py::arg("values"))
      .def(
          "note_gathered", [](RowStore& s, Channel c, uint32_t ticket) { s.note_gathered(checked(c), ticket); },
          py::arg("channel"), py::arg("ticket"),
           "Batch `ticket` of `channel` was read (what the lookup's row gather reports).");
}

// ---- the key index, in four groups: keys and lookups, the SSD tier, checkpoints, admission.
void bind_index_keys(py::class_<EmbeddingIndex>& c) {
  c.def(py::init([](std::string name, int64_t capacity, std::shared_ptr<RowStore> store, int64_t expected,
                    bool expands) {
          // An index alone (no table): rows of one float, which nothing reads.
          if (!store) store = shared_store(new RowStore(name, 1, capacity + 1, 0, shardrec::RowInit{}));
          return new EmbeddingIndex(std::move(name), capacity, store.get(), expected < 0 ? capacity : expected,
                                    expands);
        }),
        py::arg("name"), py::arg("capacity"), py::arg("store") = nullptr, py::arg("expected") = -1,
        py::arg("expands") = false)
      .def_property_readonly("name", &EmbeddingIndex::name)
      .def_property_readonly("capacity", &EmbeddingIndex::capacity)
      .def_property_readonly("sentinel", &EmbeddingIndex::sentinel)
      .def("size", &EmbeddingIndex::size)
      .def("memory_bytes", &EmbeddingIndex::memory_bytes)
      .def("counters", &EmbeddingIndex::counters)
      .def(
          "lookup",
          [](EmbeddingIndex& index, CArray<int64_t> keys, bool allocate) {
            py::array_t<int32_t> rows(keys.size());
            py::gil_scoped_release nogil;
            index.lookup(keys.data(), static_cast<size_t>(keys.size()), allocate, rows.mutable_data());
            return rows;
          },
          py::arg("keys"), py::arg("allocate") = false,
          "Rows of `keys`; allocate=True inserts unknown keys, else they get the sentinel.")
      .def(
          "erase",
          [](EmbeddingIndex& index, CArray<int64_t> keys) {
            py::gil_scoped_release nogil;
            return index.erase(keys.data(), static_cast<size_t>(keys.size()));
          },
          py::arg("keys"))
      .def(
          "clear",
          [](EmbeddingIndex& index) {
            py::gil_scoped_release nogil;
            index.clear();
          },
          "Forgets every key (the map keeps room for the whole shard).")
      .def(
          "begin_batch", [](EmbeddingIndex& index, Channel c) { return index.begin_batch(checked(c)); },
          py::arg("channel"), "A new batch of `channel`; its ticket.")
      .def("export", [](const EmbeddingIndex& index) {
        std::vector<int64_t> keys;
        std::vector<int32_t> rows;
        {
          py::gil_scoped_release nogil;
          index.export_pairs(keys, rows);
        }
        return py::make_tuple(to_numpy(keys), to_numpy(rows));
      }, "(keys, rows) of every key, in row order.");
}

void bind_index_tiers(py::class_<EmbeddingIndex>& c) {
  c.def(
       "set_ssd",
       [](EmbeddingIndex& index, int64_t records, std::vector<std::string> dirs, int rank, std::string policy) {
         if (policy != "lru" && policy != "lfu")
           throw std::invalid_argument("swap policy must be 'lru' or 'lfu', got '" + policy + "'");
         index.set_ssd(records, std::move(dirs), rank,
                       policy == "lru" ? shardrec::SwapPolicy::kLru : shardrec::SwapPolicy::kLfu);
       },
       py::arg("records"), py::arg("dirs"), py::arg("rank"), py::arg("policy") = "lfu",
       "An SSD tier of `records` rows under `dirs` (before the first key).")
      .def_property_readonly("tiered", &EmbeddingIndex::tiered)
      .def_property_readonly("max_keys", &EmbeddingIndex::max_keys, "Memory rows plus SSD rows.")
      .def("rows_on_ssd", &EmbeddingIndex::rows_on_ssd)
      .def("ssd_files", &EmbeddingIndex::ssd_files)
      .def("ssd_file_bytes", &EmbeddingIndex::ssd_file_bytes)
      .def("tier_counters", &EmbeddingIndex::tier_counters)
      .def(
          "close_ssd",
          [](EmbeddingIndex& index) {
            py::gil_scoped_release nogil;
            index.close_ssd();
          },
          "Removes the SSD tier's files.");
}

// A checkpoint's step: None for the index as it is, else the training step to take it back to.
std::pair<bool, int64_t> as_of(const py::object& step) {
  return step.is_none() ? std::make_pair(false, int64_t{0}) : std::make_pair(true, step.cast<int64_t>());
}

void bind_index_checkpoints(py::class_<EmbeddingIndex>& c) {
  c.def(
       "place",
       [](EmbeddingIndex& index, CArray<int64_t> keys) {
         py::array_t<int32_t> locs(keys.size());
         py::gil_scoped_release nogil;
         index.place(keys.data(), static_cast<size_t>(keys.size()), locs.mutable_data());
         return locs;
       },
       py::arg("keys"), "Restore: a location for each key (distinct, none held), memory first, then SSD.")
      .def(
          "read_rows",
          [](const EmbeddingIndex& index, int column, CArray<int64_t> keys, CArray<int32_t> locs) {
            const size_t n = same_length(keys, locs, locs, "keys and locations");
            py::array_t<float> out({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(index.dim())});
            py::gil_scoped_release nogil;
            index.read_rows(column, keys.data(), locs.data(), n, out.mutable_data());
            return out;
          },
          py::arg("column"), py::arg("keys"), py::arg("locations"), "Rows of any tier (checkpoints).")
      .def(
          "write_rows",
          [](EmbeddingIndex& index, int column, CArray<int64_t> keys, CArray<int32_t> locs, CArray<float> values) {
            const size_t n = same_length(keys, locs, locs, "keys and locations");
            if (values.ndim() != 2 || static_cast<size_t>(values.shape(0)) != n || values.shape(1) != index.dim())
              throw std::invalid_argument("values must be [n, dim] for n keys");
            py::gil_scoped_release nogil;
            index.write_rows(column, keys.data(), locs.data(), n, values.data());
          },
          py::arg("column"), py::arg("keys"), py::arg("locations"), py::arg("values"))
      .def(
          "snapshot",
          [](const EmbeddingIndex& index, std::vector<int> columns, py::object step) {
            const auto [at, when] = as_of(step);
            EmbeddingIndex::Snapshot snap;
            {
              py::gil_scoped_release nogil;
              snap = index.snapshot(at, when, columns);
            }
            const auto n = static_cast<py::ssize_t>(snap.state.keys.size());
            py::list rows;
            for (auto& column : snap.columns) rows.append(hand_over(std::move(column), {n, index.dim()}));
            return py::make_tuple(std::move(snap.state), rows);
          },
          py::arg("columns"), py::arg("step") = py::none(),
          "(IndexState as of training step `step` (None: as it is), the rows of `columns`), under one hold of "
          "the index's lock (no lookup moves a row in between).")
      .def(
          "save_columns",
          [](EmbeddingIndex& index, std::vector<int> columns, std::vector<std::string> paths, py::object step,
             size_t chunk_rows, const std::string& mode) {
            if (paths.size() != columns.size()) throw std::invalid_argument("one path per column expected");
            using Mode = EmbeddingIndex::SaveMode;
            const Mode m = mode == "plain" ? Mode::kPlain : mode == "full" ? Mode::kFull : mode == "delta" ? Mode::kDelta
                : throw std::invalid_argument("save mode must be 'plain', 'full' or 'delta', got '" + mode + "'");
            const auto [at, when] = as_of(step);
            EmbeddingIndex::SavedColumns saved;
            {
              py::gil_scoped_release nogil;
              saved = index.save_columns(at, when, columns, paths, chunk_rows, m);
            }
            py::list files;
            for (const auto& f : saved.files) files.append(py::make_tuple(f.bytes, f.crc));
            return py::make_tuple(std::move(saved.state), files);
          },
          py::arg("columns"), py::arg("paths"), py::arg("step") = py::none(), py::arg("chunk_rows") = 16384,
          py::arg("mode") = "plain",
          "snapshot()'s state with the columns written to `paths` as .npy files, a chunk of rows at a time "
          "(array_file.h): (IndexState, [(bytes, crc32)] per file). mode 'full' also forgets what changed "
          "since the last save; 'delta' saves only the keys whose rows changed (and IndexState.removed).")
      .def("track_changes", &EmbeddingIndex::track_changes, py::arg("on"),
           "Remembers the keys removed from now on, for the next delta save (incremental checkpoints).")
      .def("clear_changes", &EmbeddingIndex::clear_changes, "Every row as saved (after a restore).")
      .def("changed_rows", &EmbeddingIndex::changed_rows, "Keys whose rows changed since the last save.")
      .def("cleared_since_full_save", &EmbeddingIndex::cleared_since_full_save,
           "Whether clear() emptied the index since the last full save (the next save must be full).")
      .def(
          "export_as_of",
          [](const EmbeddingIndex& index, int64_t step) {
            py::gil_scoped_release nogil;
            return index.export_as_of(step);
          },
          py::arg("step"), "Every key as of training step `step` (batches looked up ahead of it undone).");
}

void bind_index_metadata(py::class_<EmbeddingIndex>& c) {
  c.def(
       "read_metadata",
       [](const EmbeddingIndex& index, CArray<int32_t> rows) {
         const size_t n = static_cast<size_t>(rows.size());
         py::array_t<uint32_t> counts(static_cast<py::ssize_t>(n));
         py::array_t<int64_t> last_seen(static_cast<py::ssize_t>(n));
         {
           py::gil_scoped_release nogil;
           index.read_metadata(rows.data(), n, counts.mutable_data(), last_seen.mutable_data());
         }
         return py::make_tuple(counts, last_seen);
       },
       py::arg("rows"), "(counts, last-seen timestamps) of rows from export().")
      .def(
          "write_metadata",
          [](EmbeddingIndex& index, CArray<int32_t> rows, CArray<uint32_t> counts, CArray<int64_t> last_seen) {
            const size_t n = same_length(rows, counts, last_seen, "rows, counts and last_seen");
            py::gil_scoped_release nogil;
            index.write_metadata(rows.data(), n, counts.data(), last_seen.data());
          },
          py::arg("rows"), py::arg("counts"), py::arg("last_seen"))
      .def("export_pending",
           [](const EmbeddingIndex& index) {
             py::gil_scoped_release nogil;
             return index.export_pending();
           })
      .def(
          "import_pending",
          [](EmbeddingIndex& index, CArray<int64_t> keys, CArray<uint32_t> counts, CArray<int64_t> last_seen) {
            const size_t n = same_length(keys, counts, last_seen, "keys, counts and last_seen");
            py::gil_scoped_release nogil;
            index.import_pending(keys.data(), counts.data(), last_seen.data(), n);
          },
          py::arg("keys"), py::arg("counts"), py::arg("last_seen"));
}

void bind_index_admission(py::class_<EmbeddingIndex>& c) {
  c.def("set_admission", &EmbeddingIndex::set_admission, py::arg("access_threshold"), py::arg("eviction_threshold"),
        "-1 turns either off.")
      .def_property_readonly("access_threshold", &EmbeddingIndex::access_threshold)
      .def_property_readonly("eviction_threshold", &EmbeddingIndex::eviction_threshold)
      .def_property("newest", &EmbeddingIndex::newest, &EmbeddingIndex::observe_newest,
                    "The newest data timestamp seen (-1 none); setting it keeps the larger.")
      .def("pending", &EmbeddingIndex::pending, "Keys counting towards admission (no row yet).")
      .def("held_back", &EmbeddingIndex::held_back, "Evicted rows not yet free (batches in flight may use them).")
      .def(
          "lookup_counted",
          [](EmbeddingIndex& index, CArray<int64_t> keys, CArray<int64_t> counts, CArray<int64_t> timestamps) {
            const size_t n = same_length(keys, counts, timestamps, "keys, counts and timestamps");
            std::vector<int64_t> meta(2 * n);
            for (size_t i = 0; i < n; ++i) {
              meta[2 * i] = counts.data()[i];
              meta[2 * i + 1] = timestamps.data()[i];
            }
            py::array_t<int32_t> rows(static_cast<py::ssize_t>(n));
            py::gil_scoped_release nogil;
            index.lookup_counted(keys.data(), meta.data(), n, rows.mutable_data());
            return rows;
          },
          py::arg("keys"), py::arg("counts"), py::arg("timestamps"),
          "A training lookup with admission: unique keys, their occurrences and newest timestamps.")
      .def("begin_step", &EmbeddingIndex::begin_step, py::arg("step"),
           "Starts the journal of a training step (the exchange calls it before the step's eviction and lookups).")
      .def(
          "evict",
          [](EmbeddingIndex& index, int64_t step) {
            py::gil_scoped_release nogil;
            return index.evict(step);
          },
          py::arg("step"))
      .def(
          "release_evicted",
          [](EmbeddingIndex& index, int64_t trained_step) {
            py::gil_scoped_release nogil;
            return index.release_evicted(trained_step);
          },
          py::arg("trained_step"), "Frees rows evicted at steps <= trained_step.");
  bind_index_metadata(c);
}

void bind_embedding_index(py::module_& m) {
  py::class_<EmbeddingIndex> c(m, "EmbeddingIndex", "One table shard's key index (embedding_index.h).");
  bind_index_keys(c);
  bind_index_tiers(c);
  bind_index_checkpoints(c);
  bind_index_admission(c);
}

// ---- the key exchange
void bind_feature_set(py::module_& m) {
  py::class_<FeatureSet>(m, "FeatureSet")
      .def(py::init([](const std::vector<std::string>& names, const std::vector<EmbeddingIndex*>& indexes,
                       const std::vector<int64_t>& send_counts, const std::vector<bool>& int32_keys,
                       std::string description, std::string timestamp_feature) {
             const size_t n = names.size();
             if (indexes.size() != n || send_counts.size() != n || int32_keys.size() != n)
               throw std::invalid_argument("names, indexes, send_counts and int32_keys need one entry per feature");
             std::vector<shardrec::ExchangeFeature> features;
             for (size_t f = 0; f < n; ++f)
               features.push_back(shardrec::ExchangeFeature{names[f], indexes[f], send_counts[f], int32_keys[f]});
             return new FeatureSet(std::move(features), std::move(description), std::move(timestamp_feature));
           }),
           py::arg("names"), py::arg("indexes"), py::arg("send_counts"), py::arg("int32_keys"), py::arg("description"),
           py::arg("timestamp_feature") = "", py::keep_alive<1, 3>(),
           "The features of one insert function, in the order every rank uses; `description` (a line per "
           "feature) is what the ranks compare.")
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
  std::vector<shardrec::RouterInput> in;
  for (size_t f = 0; f < nf; ++f) {
    arrays.push_back(feature_ids(fs, f, keys[f]));
    if (!has_data) continue;
    const py::array& a = arrays.back();
    const bool i32 = a.dtype().is(py::dtype::of<int32_t>());
    if (!i32 && !a.dtype().is(py::dtype::of<int64_t>()))
      throw py::type_error("feature '" + fs.features[f].name + "': ids must be int32 or int64, got " +
                           std::string(py::str(a.dtype())));
    in.push_back(shardrec::RouterInput{a.data(), i32, static_cast<size_t>(a.size())});
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
      .def("restart", &KeyExchange::restart,
           "Runs again after an error, unless a round timed out (init() calls it on every rank).")
      .def("run", &exchange_run, py::arg("features"), py::arg("keys"), py::arg("has_data"),
           py::arg("timestamps") = py::none(), "timestamps: the batch's is_timestamp values (int64, one per sample).")
      .def("set_eviction", &KeyExchange::set_eviction, py::arg("step_interval"),
           "Evict every step_interval training steps (0: never).")
      .def("set_step", &KeyExchange::set_step, py::arg("step"),
           "The training step the next batch follows: the global step a session starts or resumes at.")
      .def_property_readonly("step", &KeyExchange::step, "Training steps whose batches were exchanged.")
      .def_property_readonly("step_follows_training", &KeyExchange::step_follows_training,
                             "Whether set_step numbered the steps from a global step.")
      .def("request_eviction", &KeyExchange::request_eviction, "The next round evicts on every rank.")
      .def("counters", &KeyExchange::counters);
}

void bind_errors(py::module_& m) {
  py::register_exception<shardrec::CapacityError>(m, "CapacityError", PyExc_RuntimeError);
  py::register_exception<shardrec::TierDamagedError>(m, "TierDamagedError", PyExc_RuntimeError);
  auto exchange_error = py::register_exception<shardrec::ExchangeError>(m, "ExchangeError", PyExc_RuntimeError);
  py::register_exception<shardrec::ExchangeTimeout>(m, "ExchangeTimeout", exchange_error.ptr());
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

PYBIND11_MODULE(core, m) {
  m.doc() = "shardrec's native key core: per-table key index, batch dedup, all-to-all key exchange.";
  if (import_mpi4py() < 0) throw py::error_already_set();
  bind_errors(m);
  bind_values(m);
  bind_routing(m);
  bind_functions(m);
  bind_row_store(m);
  bind_embedding_index(m);
  bind_feature_set(m);
  bind_key_exchange(m);
}
