"""The rows of a checkpoint's tables as one array each, every rank's shard together, for an export.

Only values are read: optimizer slots and admission counters are training state. Files are checked
(size, header, CRC-32) as they stream into one preallocated array, so a table of several GB passes
through memory once."""
import os
from dataclasses import dataclass

import numpy as np

from ..sparse_checkpoint import CheckpointError, find_shards, read_array, read_manifest, sparse_dir, stream_array
from ..logs import get_logger

log = get_logger("shardrec.serving")


@dataclass(frozen=True)
class SavedTable:
    """One table of a checkpoint, from its manifests: what an export graph needs before any row."""
    name: str
    dim: int
    key_dtype: str
    rows: int  # over every rank


@dataclass
class SavedTables:
    """The tables of one checkpoint (a dense prefix such as <model_dir>/model.ckpt-40)."""
    save_path: str
    shards: dict  # rank -> shard directory
    manifests: dict  # rank -> manifest
    tables: dict  # name -> SavedTable

    def rows_of(self, name: str, progress=None) -> tuple:
        """(keys int64 [n], values float32 [n + 1, dim]): the last row stays zero, the row that a
        key without a row reads. progress(done_rows, total_rows) after each chunk."""
        table = self.tables[name]
        keys = np.empty(table.rows, np.int64)
        values = np.zeros((table.rows + 1, table.dim), np.float32)
        at = 0
        for rank, shard in sorted(self.shards.items()):
            entry = self.manifests[rank]["tables"].get(name)
            if entry is None:
                raise CheckpointError(f"{shard}: has no table {name!r}; every rank's shard holds every table")
            part = read_array(shard, entry["files"]["keys"], f"table {name!r} keys")
            if len(part) != entry["rows"]:
                raise CheckpointError(f"{shard}: table {name!r} has {len(part)} keys, its manifest says {entry['rows']}")
            keys[at:at + len(part)] = part
            for first, chunk in stream_array(shard, entry["files"]["values"], f"table {name!r} values"):
                values[at + first:at + first + len(chunk)] = chunk
                if progress is not None:
                    progress(at + first + len(chunk), table.rows)
            at += len(part)
        return keys, values


def saved_tables(save_path: str) -> SavedTables:
    """The tables of the checkpoint at `save_path`, every shard's manifest read and its files' sizes
    checked; raises CheckpointError naming what is missing or damaged."""
    if not os.path.exists(f"{save_path}.index"):
        raise CheckpointError(f"{save_path}: the dense part of the checkpoint ({save_path}.index) is missing")
    shards, size = find_shards(sparse_dir(save_path))
    missing = [r for r in range(size) if r not in shards]
    if missing:
        raise CheckpointError(f"{sparse_dir(save_path)}: the shards of rank(s) {missing} of {size} are missing; "
                              "an export needs every rank's rows")
    manifests = {r: read_manifest(d) for r, d in shards.items()}
    tables = {}
    for rank, manifest in sorted(manifests.items()):
        for name, entry in manifest.get("tables", {}).items():
            seen = tables.get(name)
            dim, key_dtype = int(entry["dim"]), str(entry["key_dtype"])
            if seen is not None and (seen.dim, seen.key_dtype) != (dim, key_dtype):
                raise CheckpointError(f"{shards[rank]}: table {name!r} has dim {dim} ({key_dtype} keys) here and "
                                      f"dim {seen.dim} ({seen.key_dtype} keys) in another rank's shard")
            tables[name] = SavedTable(name, dim, key_dtype, (seen.rows if seen else 0) + int(entry["rows"]))
    return SavedTables(save_path, shards, manifests, tables)
