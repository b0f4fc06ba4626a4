"""shardrec's native core (C++17, sources in src/): the per-table key index, batch dedup and the
all-to-all key exchange, as the extension module `core`. Importing `core` links MPI; the runtime
imports it only once init() has started MPI."""
