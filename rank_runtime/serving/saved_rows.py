"""The rows of a checkpoint's tables as one array each, every rank's shard together, for an export.

Only values are read: optimizer slots and admission counters are training state. Files are checked
(size, header, CRC-32) as they stream into one preallocated array, so a table of several GB passes
through memory once. An incremental checkpoint's delta is read with its chain (checkpoint_chain.py):
an export from any step of a chain holds exactly that step's rows."""
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Union

import numpy as np

from ..formats.checkpoint_chain import Link, read_chain_table, resolve, surviving, table_keys
from ..formats.sparse_checkpoint import CheckpointError, find_shards, read_manifest, sparse_dir
from ..formats.manifest import DELTA, PER_RANK
from ..process.logs import get_logger

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
    links: list  # checkpoint_chain.Link: the full save, then the deltas up to this one
    tables: dict  # name -> SavedTable

    def rows_of(self, name: str, progress: Optional[Callable[[int, int], None]] = None) -> tuple:
        """(keys int64 [n], values float32 [n + 1, dim]): the last row stays zero, the row that a
        key without a row reads. progress(done_rows, total_rows) after each chunk."""
        arrays = read_chain_table(self.links, name, ("keys", "values"), extra_rows=1, progress=progress)
        n = self.tables[name].rows
        return arrays["keys"][:n].astype(np.int64, copy=False), arrays["values"].astype(np.float32, copy=False)


def _all_shards(save_paths: list) -> tuple:
    """({rank: shard directory}, world size) over the checkpoints at `save_paths`: one path for a
    checkpoint every rank saved under the same path, one per rank for seed 001's `model-{rank}`."""
    shards, sizes = {}, set()
    for path in save_paths:
        if not os.path.exists(f"{path}.index"):
            raise CheckpointError(f"{path}: the dense part of the checkpoint ({path}.index) is missing")
        found, size = find_shards(sparse_dir(path))
        sizes.add(size)
        for rank, shard in found.items():
            if rank in shards:
                raise CheckpointError(f"rank {rank}'s shard is in two of the checkpoints given: {shards[rank]} and "
                                      f"{shard}")
            shards[rank] = shard
    if len(sizes) > 1:
        raise CheckpointError(f"{save_paths}: written by different numbers of ranks {sorted(sizes)}")
    size = sizes.pop()
    missing = [r for r in range(size) if r not in shards]
    if missing:
        layout = read_manifest(next(iter(shards.values()))).layout
        how = (f"; it was written by {size} ranks each under its own path (saver.save(sess, f'dir/model-{{rank}}')): "
               "give every rank's checkpoint prefix" if layout == PER_RANK else "")
        raise CheckpointError(f"{save_paths[0] if len(save_paths) == 1 else save_paths}: the shards of rank(s) "
                              f"{missing} of {size} are missing; an export needs every rank's rows{how}")
    return shards, size


def saved_tables(save_paths: Union[str, List[str]]) -> SavedTables:
    """The tables of the checkpoint at `save_paths` (a prefix, or one per rank for per-rank paths),
    every shard's manifest read and its files' sizes checked; raises CheckpointError naming what is
    missing or damaged. Its save_path is the prefix holding rank 0's shard (the dense part)."""
    paths = [save_paths] if isinstance(save_paths, str) else list(save_paths)
    if not paths:
        raise CheckpointError("no checkpoint given")
    shards, size = _all_shards(paths)
    manifests = {r: read_manifest(d) for r, d in shards.items()}
    first = next(p for p in paths if os.path.dirname(shards[0]) == sparse_dir(p))
    if any(m.kind == DELTA for m in manifests.values()):
        if len(paths) > 1:
            raise CheckpointError(f"{paths}: deltas of an incremental job saved under a path per rank; export a full "
                                  "save, or save under one path on every rank")
        links = resolve(first)
    else:
        links = [Link(first, shards, manifests, size)]
    steps = {m.step for m in manifests.values()}
    if len(steps) > 1:
        raise CheckpointError(f"{paths}: the shards are of different steps {sorted(steps, key=str)}")
    tables = {}
    for rank, manifest in sorted(manifests.items()):
        for name, entry in manifest.tables.items():
            seen = tables.get(name)
            dim, key_dtype = entry.dim, entry.key_dtype
            if seen is not None and (seen.dim, seen.key_dtype) != (dim, key_dtype):
                raise CheckpointError(f"{shards[rank]}: table {name!r} has dim {dim} ({key_dtype} keys) here and "
                                      f"dim {seen.dim} ({seen.key_dtype} keys) in another rank's shard")
            tables[name] = SavedTable(name, dim, key_dtype, (seen.rows if seen else 0) + entry.rows)
    if len(links) > 1:  # a delta's rows are what changed: the chain's keys say how many the step holds
        for name, table in tables.items():
            keys, removed = table_keys(links, name)
            held = sum(len(k) if m is None else int(m.sum()) for link_keys, link_masks in
                       zip(keys, surviving(keys, removed)) for k, m in zip(link_keys, link_masks))
            tables[name] = SavedTable(name, table.dim, table.key_dtype, held)
    return SavedTables(first, links, tables)
