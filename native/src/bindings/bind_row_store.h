// Bindings of the row store (storage/row_store.h): a table shard's rows, slots and metadata.
#pragma once

#include "bindings/py_arrays.h"

namespace {

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
                       double b, uint64_t seed, double scale, int32_t values_format) {
             return shared_store(new RowStore(name, dim, rows, memory_limit, row_init(kind, a, b, seed, scale),
                                              shardrec::checked_format(values_format)));
           }),
           py::arg("name"), py::arg("dim"), py::arg("rows"), py::arg("memory_limit"), py::arg("init_kind"),
           py::arg("init_a"), py::arg("init_b"), py::arg("seed"), py::arg("scale"), py::arg("values_format") = 0,
           "A shard's rows: `rows` reserved (the sentinel included), in use a chunk at a time; init_kind 0 "
           "constant a, 1 uniform [a, b), 2 normal (mean a, stddev b), 3 truncated normal; values times scale; "
           "values_format 0 float32, 1 float16, 2 bfloat16.")
      .def_property_readonly("address", [](RowStore& s) { return reinterpret_cast<uintptr_t>(&s); })
      .def_property_readonly("dim", &RowStore::dim)
      .def_property_readonly("rows", &RowStore::rows, "Rows reserved, the sentinel included.")
      .def_property_readonly("in_use", &RowStore::in_use)
      .def_property_readonly("n_columns", &RowStore::n_columns)
      .def_property_readonly("chunk_rows", [](const RowStore&) { return RowStore::kChunkRows; })
      .def_property_readonly("bytes_per_row", &RowStore::bytes_per_row,
                             "Bytes of one row in use: values, every slot column, metadata.")
      .def_property_readonly("memory_limit", &RowStore::memory_limit, "Bytes of rows in use at most (0: none).")
      .def(
          "add_column",
          [](RowStore& s, float init, int32_t format) { return s.add_column(init, shardrec::checked_format(format)); },
          py::arg("init"), py::arg("format") = 0,
          "An optimizer slot column (format 0 float32, 2 bfloat16, 1 float16); returns its number.")
      .def(
          "column_dtype", [](const RowStore& s, int c) {
            if (c < 0 || c >= s.n_columns()) throw std::out_of_range("no column " + std::to_string(c));
            return std::string(shardrec::manifest_dtype(s.format(c)));
          },
          py::arg("column"), "How a checkpoint's manifest names the column's dtype: <f4, <f2 or bfloat16.")
      .def(
          "set_init",
          [](RowStore& s, int kind, double a, double b, uint64_t seed, double scale) {
            s.set_init(row_init(kind, a, b, seed, scale));
          },
          py::arg("init_kind"), py::arg("init_a"), py::arg("init_b"), py::arg("seed"), py::arg("scale"),
          "How rows drawn from now on start (rows taken again after an eviction included).")
      .def("bytes", &RowStore::bytes)
      .def_property("stochastic_rounding", &RowStore::stochastic_rounding, &RowStore::set_stochastic_rounding,
                    "Whether the optimizers round a 16-bit row stochastically (else to the nearest).")
      .def(
          "read_rows",
          [](const RowStore& store, int c, CArray<int32_t> rows) {
            check_rows_in_use(store, c, rows);
            py::array_t<float> out({static_cast<int64_t>(rows.size()), store.dim()});
            py::gil_scoped_release nogil;
            store.read_rows(c, rows.data(), rows.size(), out.mutable_data());
            return out;
          },
          py::arg("column"), py::arg("rows"), "Column `column` of `rows` (every one in use), as float32 [n, dim].")
      .def(
          "write_rows",
          [](RowStore& store, int c, CArray<int32_t> rows, CArray<float> values) {
            check_rows_in_use(store, c, rows);
            if (values.ndim() != 2 || values.shape(0) != rows.size() || values.shape(1) != store.dim())
              throw std::invalid_argument("values must be [len(rows), dim]");
            py::gil_scoped_release nogil;
            store.write_rows(c, rows.data(), rows.size(), values.data());
          },
          py::arg("column"), py::arg("rows"), py::arg("values"),
          "Writes float32 `values` into `rows` of column `column` (a 16-bit column: each to the nearest).")
      .def(
          "note_gathered", [](RowStore& s, Channel c, uint32_t ticket) { s.note_gathered(checked(c), ticket); },
          py::arg("channel"), py::arg("ticket"),
           "Batch `ticket` of `channel` was read (what the lookup's row gather reports).");
}

}  // namespace
