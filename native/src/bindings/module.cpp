// The pybind11 module: numpy arrays in and out, the GIL released around every loop over keys and
// every MPI call. One binding function per class, in a header of its own (one translation unit);
// what crosses to Python is a typed value with read-only fields (counters, an index's state, a
// batch's routing), never a dict built by hand.
#include "bindings/bind_exchange.h"
#include "bindings/bind_index.h"
#include "bindings/bind_row_store.h"
#include "bindings/bind_values.h"

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
