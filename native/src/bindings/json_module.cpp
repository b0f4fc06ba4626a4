// shardrec-serve's REST bodies parsed into Python values whose rectangular arrays of numbers are
// numpy arrays, filled by the scanner of serving/json_numbers.h with no Python object per number
// (Python's json makes one per number, and numpy reads them back one by one: about 1 ms of CPU for
// a 256 x 26 request). A module of its own that links no MPI: the server is not a rank.
#include <Python.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <utility>
#include <vector>

#include "serving/json_numbers.h"

namespace py = pybind11;
using shardrec::serving::JsonError;
using shardrec::serving::JsonScanner;
using shardrec::serving::NumberArray;

namespace {

constexpr int kMaxDepth = 512;

struct TooDeep {};

// The buffer becomes the array's memory (no copy): the capsule frees the vector with the array.
template <typename T>
py::object owned_array(std::vector<T>&& values, const std::vector<int64_t>& shape, py::dtype dtype) {
  auto* held = new std::vector<T>(std::move(values));
  py::capsule free_it(held, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  std::vector<py::ssize_t> dims(shape.begin(), shape.end());
  return py::array(dtype, dims, {}, held->data(), free_it);
}

py::object decode(const std::string& bytes, size_t at) {
  PyObject* s = PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "surrogatepass");
  if (s == nullptr) {
    PyErr_Clear();
    throw JsonError("a string that is not UTF-8", at);
  }
  return py::reinterpret_steal<py::object>(s);
}

py::object value(JsonScanner& in, int depth) {
  if (depth > kMaxDepth) throw TooDeep();
  char c = in.peek();
  size_t at = in.offset();
  if (c == '{') {
    in.expect('{');
    py::dict out;
    if (in.take('}')) return std::move(out);
    while (true) {
      if (in.peek() != '"') throw JsonError("expected a string key", in.offset());
      py::object key = decode(in.string(), at);
      in.expect(':');
      out[key] = value(in, depth + 1);
      if (in.take('}')) return std::move(out);
      if (!in.take(',')) throw JsonError("expected ',' or '}'", in.offset());
    }
  }
  if (c == '[') {
    NumberArray numbers;
    if (in.number_array(numbers)) {
      switch (numbers.kind) {
        case NumberArray::kInt: return owned_array(std::move(numbers.ints), numbers.shape, py::dtype::of<int64_t>());
        case NumberArray::kFloat: return owned_array(std::move(numbers.floats), numbers.shape, py::dtype::of<double>());
        case NumberArray::kBool: return owned_array(std::move(numbers.bools), numbers.shape, py::dtype("bool"));
      }
    }
    in.expect('[');
    py::list out;
    if (in.take(']')) return std::move(out);
    while (true) {
      out.append(value(in, depth + 1));
      if (in.take(']')) return std::move(out);
      if (!in.take(',')) throw JsonError("expected ',' or ']'", in.offset());
    }
  }
  if (c == '"') return decode(in.string(), at);
  if (in.match("true")) return py::bool_(true);
  if (in.match("false")) return py::bool_(false);
  if (in.match("null")) return py::none();
  bool integer;
  std::string text = in.number_text(integer);
  if (integer) return py::reinterpret_steal<py::object>(PyLong_FromString(text.c_str(), nullptr, 10));
  return py::float_(JsonScanner::to_double_of(text));
}

py::object parse(py::bytes body) {
  char* data;
  Py_ssize_t size;
  PyBytes_AsStringAndSize(body.ptr(), &data, &size);
  JsonScanner in(data, static_cast<size_t>(size));
  try {
    py::object out = value(in, 0);
    if (!in.done()) throw JsonError("extra data after the value", in.offset());
    return out;
  } catch (const JsonError& e) {
    throw py::value_error(e.what());
  } catch (const TooDeep&) {
    throw py::value_error("the body is nested too deeply (a request's values are lists of at most a tensor's "
                          "rank, 32 levels)");
  }
}

}  // namespace

PYBIND11_MODULE(json_arrays, m) {
  m.doc() = "JSON request bodies with rectangular arrays of numbers read straight into numpy arrays";
  m.def("parse", &parse, py::arg("body"),
        "The JSON value of `body` (UTF-8 bytes): objects as dicts, strings as str, and every non-empty "
        "rectangular array of numbers as one numpy array (int64 when every number is an integer in range, "
        "else float64; bool for true/false), other arrays as lists. ValueError says what is wrong and where.");
}
