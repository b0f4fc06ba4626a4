"""A table shard's rows on their way out: to a checkpoint's files (table_writer, written by the
native core a chunk at a time, from memory and the SSD tier), or to numpy (read_table_rows, for
table.export and shardrec-ckpt). Keys and rows are taken under one hold of the index's lock: the
input pipeline, which may move rows between tiers, waits.
"""
import os
from typing import Any, Callable, Dict, Optional

import numpy as np

from ..process.logs import get_logger
from ..formats.sparse_checkpoint import admission_arrays
from ..formats.manifest import REMOVED, AdmissionEntry, TableEntry
from ..formats.array_files import array_entry, write_array
from ..formats.sharding_plan import REPLICATED
from ..process.world import get_world
from . import column_slices

log = get_logger("shardrec.saver")

# Rows per chunk on the way from the row store to a checkpoint file: with dim 64 and lazy Adam, 4 MiB.
SAVE_CHUNK_ROWS = 16384
# The step of a save without global_step: the index as it is.
NO_STEP = 2**62


def read_table_rows(sess: Any, table: Any) -> Dict[str, np.ndarray]:
    """{"keys", "values", slot names...} of the keys this rank's shard holds, in row order, read
    from the native row store (no session run; `sess` is kept for callers)."""
    names = list(table.columns)
    state, columns = table.index.snapshot([table.columns[n] for n in names])
    return {"keys": state.keys, **dict(zip(names, columns))}


def table_writer(table: Any, step: Optional[int], mode: str = "plain") -> Callable[[str], TableEntry]:
    """write_shard's writer for one table: its keys, and its values and slot rows written by the
    native core straight from the store and the SSD tier into the files. With admission, the keys'
    counts and timestamps and the keys still counting, as of training step `step` (the batches the
    input pipeline looked up beyond it taken back, embedding_index.h; admission/steps.py says
    when), so that a restore at `step` goes on exactly as this run does. step None: the index as it is.
    mode: "plain", "full" (an incremental job's full save: what changed is forgotten) or "delta"
    (the rows that changed since the previous save, and the keys removed since)."""
    def write(folder):
        names = list(table.columns)
        counts = table.thresholds is not None and table.thresholds.counts
        as_of = (NO_STEP if step is None else step) if counts else None
        # A replica writes its share of a replicated table (keys by key mod world size): each key once.
        share = (get_world().size, get_world().rank) if table.placement.kind == REPLICATED else (1, 0)

        def save_into(where):
            paths = {n: os.path.join(where, f"{n}.npy") for n in names}
            state, digests = table.index.save_columns([table.columns[n] for n in names], [paths[n] for n in names],
                                                      as_of, SAVE_CHUNK_ROWS, mode, *share)
            return state, paths, digests

        if table.placement.native_slices > 1:  # whole rows, on the first slice rank (column_slices.py)
            state, files, holds = column_slices.save_joined(table, names, folder, lambda where: save_into(where)[:2])
            keys = state.keys if holds else state.keys[:0]
        else:
            state, _, digests = save_into(folder)
            keys, holds, files = state.keys, True, {}
            for name, (nbytes, crc) in zip(names, digests):
                # As the store holds the column: <f4, <f2 or bfloat16 (row_dtypes.py).
                files[name] = array_entry(f"{name}.npy", nbytes, crc, table.store.column_dtype(table.columns[name]),
                                          (len(keys), table.dim))
        files = {"keys": write_array(folder, "keys", keys), **files}
        admission = None
        if counts:
            if not state.exact and holds:
                log.warning("table %r: the checkpoint of step %s holds the counts of batches the input pipeline "
                            "looked up beyond it (more than the index keeps a journal of); a restore counts them "
                            "twice", table.table_name, step)
            arrays = {name: array if holds else array[:0] for name, array in admission_arrays(state).items()}
            for name, array in arrays.items():
                files[name] = write_array(folder, name, array)
            admission = AdmissionEntry(table.thresholds.access, table.thresholds.eviction, state.newest,
                                       len(arrays["pending_keys"]))
        removed = None
        if mode == "delta":
            gone = state.removed if holds else state.removed[:0]
            files[REMOVED] = write_array(folder, REMOVED, gone)
            removed = len(gone)
        return TableEntry(dim=table.dim, key_dtype=table.key_dtype.name, rows=len(keys),
                          optimizers=sorted(table.optimizers), slots=sorted(n for n in names if n != "values"),
                          files=files, admission=admission, removed_rows=removed, sharding=table.plan)

    return write
