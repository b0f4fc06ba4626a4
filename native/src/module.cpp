// The pybind11 module: numpy arrays in and out, the GIL released around every loop over keys.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "batch_dedup.h"
#include "embedding_index.h"

namespace py = pybind11;
using shardrec::BatchDedup;
using shardrec::EmbeddingIndex;

namespace {

template <typename T>
using CArray = py::array_t<T, py::array::c_style>;

template <typename T>
py::array_t<T> to_numpy(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

template <typename Key>
py::tuple process_batch(EmbeddingIndex& index, CArray<Key> keys, bool allocate, int64_t pad_to) {
  const size_t n = static_cast<size_t>(keys.size());
  py::array_t<int32_t> restore(static_cast<py::ssize_t>(n));
  shardrec::BatchResult r;
  {
    py::gil_scoped_release nogil;
    r = index.process_batch(keys.data(), n, allocate, pad_to, restore.mutable_data());
  }
  return py::make_tuple(to_numpy(r.slots), restore, r.num_unique);
}

template <typename Key>
py::array_t<int32_t> lookup(EmbeddingIndex& index, CArray<Key> keys, bool allocate) {
  py::array_t<int32_t> slots(keys.size());
  {
    py::gil_scoped_release nogil;
    index.lookup(keys.data(), static_cast<size_t>(keys.size()), allocate, slots.mutable_data());
  }
  return slots;
}

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

}  // namespace

PYBIND11_MODULE(shardrec_native, m) {
  m.doc() = "shardrec's native key core: per-table key index, batch dedup.";
  py::register_exception<shardrec::CapacityError>(m, "CapacityError", PyExc_RuntimeError);

  m.def("dedup", &dedup<int64_t>, py::arg("keys"));
  m.def("dedup", &dedup<int32_t>, py::arg("keys"),
        "Unique keys in first-seen order and restore indices (unique[restore] == keys).");

  py::class_<EmbeddingIndex>(m, "EmbeddingIndex")
      .def(py::init<std::string, int64_t>(), py::arg("name"), py::arg("capacity"))
      .def_property_readonly("name", &EmbeddingIndex::name)
      .def_property_readonly("capacity", &EmbeddingIndex::capacity)
      .def_property_readonly("sentinel", &EmbeddingIndex::sentinel)
      .def("size", &EmbeddingIndex::size)
      .def("memory_bytes", &EmbeddingIndex::memory_bytes)
      .def("process_batch", &process_batch<int64_t>, py::arg("keys"), py::arg("allocate"), py::arg("pad_to") = 0)
      .def("process_batch", &process_batch<int32_t>, py::arg("keys"), py::arg("allocate"), py::arg("pad_to") = 0,
           "Dedup a batch and map its unique keys to slots: returns (slots, restore, num_unique).")
      .def("lookup", &lookup<int64_t>, py::arg("keys"), py::arg("allocate") = false)
      .def("lookup", &lookup<int32_t>, py::arg("keys"), py::arg("allocate") = false)
      .def(
          "erase",
          [](EmbeddingIndex& index, CArray<int64_t> keys) {
            py::gil_scoped_release nogil;
            return index.erase(keys.data(), static_cast<size_t>(keys.size()));
          },
          py::arg("keys"))
      .def("export", [](const EmbeddingIndex& index) {
        std::vector<int64_t> keys;
        std::vector<int32_t> slots;
        {
          py::gil_scoped_release nogil;
          index.export_pairs(keys, slots);
        }
        return py::make_tuple(to_numpy(keys), to_numpy(slots));
      })
      .def("counters", [](const EmbeddingIndex& index) {
        const auto c = index.counters();
        py::dict d;
        d["batches"] = c.batches;
        d["keys_seen"] = c.keys_seen;
        d["unique_seen"] = c.unique_seen;
        d["inserted"] = c.inserted;
        d["missed"] = c.missed;
        d["erased"] = c.erased;
        return d;
      });
}
