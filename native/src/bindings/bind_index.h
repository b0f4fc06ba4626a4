// Bindings of the key index (index/embedding_index.h), in groups: keys and lookups, the SSD tier,
// checkpoints, admission metadata, admission and eviction.
#pragma once

#include "bindings/bind_row_store.h"
#include "bindings/py_arrays.h"

namespace {

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
             size_t chunk_rows, const std::string& mode, int keep_world, int keep_rank) {
            if (keep_world < 1 || keep_rank < 0 || keep_rank >= keep_world)
              throw std::invalid_argument("keep_rank must be in [0, keep_world)");
            if (paths.size() != columns.size()) throw std::invalid_argument("one path per column expected");
            using Mode = EmbeddingIndex::SaveMode;
            const Mode m = mode == "plain" ? Mode::kPlain : mode == "full" ? Mode::kFull : mode == "delta" ? Mode::kDelta
                : throw std::invalid_argument("save mode must be 'plain', 'full' or 'delta', got '" + mode + "'");
            const auto [at, when] = as_of(step);
            EmbeddingIndex::SavedColumns saved;
            {
              py::gil_scoped_release nogil;
              saved = index.save_columns(at, when, columns, paths, chunk_rows, m, keep_world, keep_rank);
            }
            py::list files;
            for (const auto& f : saved.files) files.append(py::make_tuple(f.bytes, f.crc));
            return py::make_tuple(std::move(saved.state), files);
          },
          py::arg("columns"), py::arg("paths"), py::arg("step") = py::none(), py::arg("chunk_rows") = 16384,
          py::arg("mode") = "plain", py::arg("keep_world") = 1, py::arg("keep_rank") = 0,
          "snapshot()'s state with the columns written to `paths` as .npy files, a chunk of rows at a time "
          "(array_file.h): (IndexState, [(bytes, crc32)] per file). mode 'full' also forgets what changed "
          "since the last save; 'delta' saves only the keys whose rows changed (and IndexState.removed). "
          "keep_world > 1: only the keys with key mod keep_world == keep_rank (a replicated table's share).")
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

}  // namespace
