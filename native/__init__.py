"""shardrec's native core (C++17, sources in src/): the per-table key index, batch dedup and the
all-to-all key exchange, as the extension module `core`. Importing `core` links MPI; the runtime
imports it only once init() has started MPI. `framing` (TFRecord framing: counted, split, packed)
links no MPI, for processes that are not ranks (a stream's producers)."""
