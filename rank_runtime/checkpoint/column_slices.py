"""A column-wise table's slices joined into whole rows on their way to a checkpoint, so that every
reader of checkpoints (a restore under any plan and rank count, warm start, deltas, the serving
export, shardrec-serve) sees the table as any other: each key once, with its whole row.

Each slice rank saves its own columns as any shard does (the native core's save, with its deltas,
removed keys and admission state as of the save's step), into a folder of its own; the slices after
the first send their keys and columns to the first, which puts each slice's rows in its own key
order (the slices hold the same keys: the key round gives every slice the same keys, counts and
timestamps, so admission and eviction decide alike on each) and writes whole rows. The other slice
ranks write the table with no keys, as a table-wise table's other ranks do. A slice that fails
tells the first, which fails too: the save's agreement (rank_agreement.py) then fails on every rank.
"""
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

from ..formats.array_files import ArrayEntry, CheckpointError, write_array
from ..process.world import get_world

# (the native save's state, {column name: its .npy path}) of one slice, saved into a folder
SaveInto = Callable[[str], Tuple[object, Dict[str, str]]]


def save_joined(table: Any, names: List[str], folder: str,
                save_into: SaveInto) -> Tuple[object, Dict[str, ArrayEntry], bool]:
    """(this slice's save state, the column files written into `folder`, whether they hold the keys):
    on the first slice rank the whole rows of every key, on the others none."""
    placement, world = table.placement, get_world()
    first, slices = placement.native, placement.native_slices
    what = f"table {table.table_name!r}: joining its {slices} column slices for the checkpoint"
    timeout = world.exchange_timeout_s
    if world.rank != first:
        try:
            state, arrays = _saved(folder, names, save_into)
        except Exception as e:  # the first slice must learn of it, or it waits for these rows
            world.send_arrays(first, [], what, timeout, error=f"{type(e).__name__}: {e}")
            raise
        world.send_arrays(first, arrays, what, timeout)
        return state, {n: _written(table, folder, n, np.zeros((0, table.dim), arrays[1 + i].dtype))
                       for i, n in enumerate(names)}, False
    # Every other slice's rows first, whatever fails here after: no slice rank is left waiting.
    received, failed = [], []
    for r in range(first + 1, first + slices):
        try:
            received.append(world.receive_arrays(r, what, timeout))
        except (RuntimeError, TimeoutError) as e:
            failed.append(str(e))
    if failed:
        raise CheckpointError("; ".join(failed))
    state, mine = _saved(folder, names, save_into)
    keys = mine[0]
    joined = [[column] for column in mine[1:]]
    for r, (other_keys, *columns) in zip(range(first + 1, first + slices), received):
        order = _aligned(table, keys, other_keys, first, r)
        for i, column in enumerate(columns):
            joined[i].append(column[order])
    files = {n: _written(table, folder, n, np.concatenate(parts, axis=1)) for n, parts in zip(names, joined)}
    return state, files, True


def _saved(folder: str, names: List[str], save_into: SaveInto) -> Tuple[object, List[np.ndarray]]:
    """This slice saved by the native core into a scratch folder, read back: (state, [keys, columns...])."""
    scratch = tempfile.mkdtemp(prefix=".slice-", dir=folder)
    try:
        state, paths = save_into(scratch)
        return state, [np.asarray(state.keys, np.int64)] + [np.load(paths[n]) for n in names]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _aligned(table: Any, keys: np.ndarray, other: np.ndarray, first: int, rank: int) -> np.ndarray:
    """Where each of `keys` sits among `other` (rank `rank`'s keys), or a CheckpointError when the
    two slices do not hold the same keys."""
    mine, theirs = np.argsort(keys, kind="stable"), np.argsort(other, kind="stable")
    if len(keys) != len(other) or not np.array_equal(keys[mine], other[theirs]):
        raise CheckpointError(f"table {table.table_name!r}: its column slices hold different keys ({len(keys)} on rank "
                              f"{first}, {len(other)} on rank {rank}); the save is refused (the previous checkpoint "
                              "stays the latest)")
    return theirs[np.argsort(mine, kind="stable")]


def _written(table: Any, folder: str, name: str, array: np.ndarray) -> ArrayEntry:
    """Writes one column's rows as the store holds them (float32, float16, or bfloat16's bits)."""
    entry = write_array(folder, name, array)
    return ArrayEntry(entry.file, entry.bytes, entry.crc32, table.store.column_dtype(table.columns[name]),
                      entry.shape)
