// TFRecord framing for Python, in a module of its own that links no MPI: producers pack records for
// a Redis stream (pack_tfrecords) and scripts count a file's records in processes that are not
// ranks. Importing the key core there would start MPI as a singleton, which leaves its 16 MiB
// segment in /dev/shm at exit.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "storage/tfrecord_framing.h"

namespace py = pybind11;

namespace {

// As py_arrays.h's, which this module cannot include: that header brings in mpi4py and the exchange.
template <typename T>
py::array_t<T> to_numpy(const std::vector<T>& v) {
  py::array_t<T> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(T));
  return a;
}

// Pointers into Python bytes objects, read while the caller holds them (and the GIL at first).
std::vector<std::pair<const char*, int64_t>> bytes_views(const py::tuple& items, const char* what) {
  std::vector<std::pair<const char*, int64_t>> out;
  out.reserve(items.size());
  for (const py::handle item : items) {
    if (!PyBytes_Check(item.ptr()))
      throw py::type_error(std::string(what) + ": every item must be bytes, got " +
                           py::str(py::type::of(item)).cast<std::string>());
    out.emplace_back(PyBytes_AS_STRING(item.ptr()), static_cast<int64_t>(PyBytes_GET_SIZE(item.ptr())));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(framing, m) {
  m.doc() = "TFRecord framing: a file's record count, records framed in memory, records packed.";
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const shardrec::FileError& e) {  // an OSError with its errno, as Python's own I/O
      py::object error = py::module_::import("builtins").attr("OSError")(e.code().value(), e.what());
      PyErr_SetObject(PyExc_OSError, error.ptr());
    }
  });
  py::class_<shardrec::TFRecordCount>(m, "TFRecordCount")
      .def_readonly("records", &shardrec::TFRecordCount::records, "Complete records before bad_offset.")
      .def_readonly("size", &shardrec::TFRecordCount::size, "The file's bytes.")
      .def_readonly("bad_offset", &shardrec::TFRecordCount::bad_offset,
                    "Where the framing stops adding up (-1: it adds up to the end).")
      .def_readonly("bad_length", &shardrec::TFRecordCount::bad_length,
                    "The length the record there claims (-1: its header is cut short).")
      .def_readonly("bad_crc", &shardrec::TFRecordCount::bad_crc,
                    "With check_crc: 'length' or 'data', the CRC there that does not match ('' if none).");
  m.def(
      "count_tfrecords",
      [](const std::string& path, bool check_crc) {
        py::gil_scoped_release nogil;
        return shardrec::count_tfrecords(path, check_crc);
      },
      py::arg("path"), py::arg("check_crc") = false,
      "A TFRecord file's records, counted from its framing (with check_crc, both CRCs of every record checked; "
      "without it the data is not read).");
  py::class_<shardrec::FramedRecords>(m, "FramedRecords")
      .def_property_readonly("starts", [](const shardrec::FramedRecords& f) { return to_numpy(f.starts); },
                             "Where each record's data starts in the blobs joined.")
      .def_property_readonly("lengths", [](const shardrec::FramedRecords& f) { return to_numpy(f.lengths); },
                             "Each record's bytes.")
      .def_property_readonly("counts", [](const shardrec::FramedRecords& f) { return to_numpy(f.counts); },
                             "Records of each blob (up to and with the bad one).")
      .def_readonly("bad_blob", &shardrec::FramedRecords::bad_blob,
                    "The first blob that is not TFRecord framing (-1: none).")
      .def_readonly("bad_offset", &shardrec::FramedRecords::bad_offset, "The byte of it where the bad record starts.")
      .def_readonly("bad_reason", &shardrec::FramedRecords::bad_reason, "What is wrong there.");
  m.def(
      "frame_tfrecords",
      [](const py::sequence& blobs) {
        const py::tuple held(blobs);  // its items stay alive while the GIL is released
        const auto views = bytes_views(held, "frame_tfrecords");
        py::gil_scoped_release nogil;
        return shardrec::frame_tfrecords(views);
      },
      py::arg("blobs"), "The records of blobs of TFRecord framing (a TFRecord file's bytes each), CRCs checked.");
  m.def(
      "pack_tfrecords",
      [](const py::sequence& records) {
        const py::tuple held(records);
        const auto views = bytes_views(held, "pack_tfrecords");
        Py_ssize_t total = 0;
        for (const auto& v : views) total += 16 + v.second;
        py::bytes out(nullptr, static_cast<size_t>(total));
        shardrec::pack_tfrecords(views, PyBytes_AS_STRING(out.ptr()));
        return out;
      },
      py::arg("records"), "The bytes of a TFRecord file that holds `records` (bytes each).");
}
