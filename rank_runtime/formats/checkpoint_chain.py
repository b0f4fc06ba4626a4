"""Chains of incremental checkpoints: a delta save and the saves it builds on, back to its full base
(sparse_checkpoint.py describes the format). A restore, warm start, `shardrec-ckpt` and the serving
export read a table of a chain as one table: every link's keys, each key's row from the newest link
that holds it, less the keys a later link removed; the pending keys of the last link.

A link that is missing, damaged, of another world size, or replaced by another save of the same
step (its save_id differs from the one the delta recorded) makes the whole chain refused, naming
that link. Imports no TensorFlow.
"""
import os
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from .sparse_checkpoint import MANIFEST, CheckpointError, find_shards, read_manifest, shard_name, sparse_dir
from .manifest import DELTA, FULL, PENDING, REMOVED, SaveRef, ShardManifest, TableEntry
from .array_files import read_array, stream_array

# A chain longer than this is a loop in damaged manifests, not a job's saves.
_MAX_LINKS = 100_000


@dataclass
class Link:
    """One save of a chain: its dense prefix, the shards read of it ({rank: directory}) and their
    manifests, and the world size that wrote it."""
    path: str
    shards: Dict[int, str]
    manifests: Dict[int, ShardManifest]
    world_size: int

    @property
    def _manifest(self) -> ShardManifest:
        return self.manifests[min(self.manifests)]

    @property
    def kind(self) -> str:
        return self._manifest.kind

    @property
    def step(self) -> Optional[int]:
        return self._manifest.step

    @property
    def save_id(self) -> Optional[str]:
        return self._manifest.save_id

    @property
    def previous(self) -> SaveRef:
        """The save this delta builds on (a delta's manifest always names it: read_manifest checks)."""
        assert self._manifest.previous is not None
        return self._manifest.previous

    @property
    def base(self) -> SaveRef:
        """The full save at the start of this delta's chain."""
        assert self._manifest.base is not None
        return self._manifest.base


def every_shard(root: str) -> tuple:
    """({rank: shard} of every rank, the world size) of a save read whole (tools, export)."""
    shards, size = find_shards(root)
    missing = [r for r in range(size) if r not in shards]
    if missing:
        raise CheckpointError(f"{root}: the shards of rank(s) {missing} of {size} are missing (no committed "
                              f"{shard_name(missing[0], size)}/{MANIFEST}); the save did not finish on every rank")
    return shards, size


def link_of(save_path: str, select=every_shard) -> Link:
    """The save at `save_path`, its shards chosen by select(sparse directory) -> (shards, size)."""
    shards, size = select(sparse_dir(save_path))
    manifests = {r: read_manifest(d) for r, d in sorted(shards.items())}
    link = Link(save_path, shards, manifests, size)
    for rank, manifest in manifests.items():
        mine = (manifest.kind, manifest.save_id, manifest.step)
        if mine != (link.kind, link.save_id, link.step):
            raise CheckpointError(f"{shards[rank]}/{MANIFEST}: says {mine[0]} save {mine[1]} of step {mine[2]}, "
                                  f"another shard of the same checkpoint {link.kind} save {link.save_id} of step "
                                  f"{link.step}: shards of different saves")
    if link.kind not in (FULL, DELTA):
        raise CheckpointError(f"{shards[min(shards)]}/{MANIFEST}: kind {link.kind!r}; a save is {FULL!r} or {DELTA!r}")
    return link


def resolve(save_path: str, select=every_shard) -> list:
    """[Link] from the full save to the one at `save_path` (one link for a full save). Raises
    CheckpointError naming the link that is missing, damaged or not the one the delta was saved on."""
    links = [link_of(save_path, select)]
    while links[-1].kind == DELTA:
        if len(links) > _MAX_LINKS:
            raise CheckpointError(f"{save_path}: a chain of more than {_MAX_LINKS} saves; its manifests are damaged")
        delta = links[-1]
        previous, base = delta.previous, delta.base
        path = os.path.join(os.path.dirname(os.path.abspath(delta.path)), previous.name)
        why = (f"{save_path} is an incremental checkpoint, restored with the saves it builds on: "
               f"{os.path.basename(delta.path)} holds what changed since {path} (step {previous.step})")
        try:
            link = link_of(path, select)
        except CheckpointError as e:
            raise CheckpointError(f"{why}, and that one cannot be read: {e}. Restore a full checkpoint or "
                                  "another chain (shardrec-ckpt inspect lists them)") from None
        found = (link.save_id, link.step, link.world_size)
        if found != (previous.save_id, previous.step, delta.world_size):
            raise CheckpointError(f"{why}, but {path} is another save (save {link.save_id} of step {link.step} by "
                                  f"{link.world_size} ranks, not save {previous.save_id} of step {previous.step} by "
                                  f"{delta.world_size}): it was saved again since, so the chain is broken")
        if link.kind == FULL and link.save_id != base.save_id or link.kind == DELTA and link.base != base:
            raise CheckpointError(f"{why}, but {path} belongs to another chain (its base is not {base.name}, "
                                  f"save {base.save_id})")
        links.append(link)
    links.reverse()
    return links


def surviving(keys: list, removed: list) -> list:
    """For each link (oldest first), for each of its key arrays, the mask of keys that the chain's
    end still holds from that link (None: all): a key is superseded by any later link that holds or
    removed it. keys: [[key array per shard] per link]; removed: [removed key array per link]."""
    masks: list = [None] * len(keys)
    later = np.empty(0, np.int64)
    for i in range(len(keys) - 1, -1, -1):
        masks[i] = [None if not later.size else ~np.isin(k, later) for k in keys[i]]
        if i:
            later = np.unique(np.concatenate([later, *[np.asarray(k, np.int64) for k in keys[i]],
                                              np.asarray(removed[i], np.int64)]))
    return masks


def table_keys(links: list, table: str) -> tuple:
    """([[keys per shard] per link], [removed keys per link]) of `table`, read and checked."""
    keys, removed = [], []
    for link in links:
        keys.append([read_array(shard, _entry(link, rank, table).files["keys"], f"table {table!r} keys")
                     for rank, shard in sorted(link.shards.items())])
        gone = [read_array(shard, _entry(link, rank, table).files[REMOVED], f"table {table!r} removed")
                for rank, shard in sorted(link.shards.items()) if link.kind == DELTA]
        removed.append(np.concatenate(gone) if gone else np.empty(0, np.int64))
    return keys, removed


def _entry(link, rank, table) -> TableEntry:
    entry = link.manifests[rank].tables.get(table)
    if entry is None:
        raise CheckpointError(f"{link.shards[rank]}/{MANIFEST}: has no table {table!r}; it has "
                              f"{sorted(link.manifests[rank].tables)}")
    if link.kind == DELTA and REMOVED not in entry.files:
        raise CheckpointError(f"{link.shards[rank]}/{MANIFEST}: table {table!r} of a delta has no {REMOVED!r} array")
    return entry


def read_chain_table(links: list, table: str, names=None, extra_rows: int = 0, progress=None) -> dict:
    """{array name: the chain end's rows of `table`, every rank's, in link and rank order}, each file
    streamed into one preallocated array and checked on the way (size, header, CRC-32), so that a
    table passes through memory once. names: the arrays to read (default: all); extra_rows: zero
    rows appended to each; progress(rows done, rows in all) after each chunk. Pending arrays come
    from the last link. Raises CheckpointError."""
    keys, removed = table_keys(links, table)
    masks = surviving(keys, removed)
    last = links[-1]
    all_names = sorted({n for link in links for r in link.shards for n in _entry(link, r, table).files} - {REMOVED})
    names = list(names) if names is not None else all_names
    parts = [(link, rank, mask) for link, link_masks in zip(links, masks)
             for (rank, _), mask in zip(sorted(link.shards.items()), link_masks)]
    total_rows = sum(len(k) if m is None else int(m.sum()) for link_keys, link_masks in zip(keys, masks)
                     for k, m in zip(link_keys, link_masks))
    out, done = {}, 0
    for name in names:
        chosen = [(last, r, None) for r in sorted(last.shards)] if name in PENDING else parts
        items = []
        for link, rank, mask in chosen:
            entry = _entry(link, rank, table)
            item = entry.files.get(name)
            if item is None or entry.rows_of(name) is None or item.rows != entry.rows_of(name):
                raise CheckpointError(f"{link.shards[rank]}: table {table!r} has no {name!r} array of the rows "
                                      "its manifest says")
            items.append((link, rank, mask, item))
        first = items[0][3]
        rows = sum(i.rows if m is None else int(m.sum()) for _, _, m, i in items)
        array = (np.zeros if extra_rows else np.empty)((rows + extra_rows, *first.shape[1:]), np.dtype(first.dtype))
        at = 0
        for link, rank, mask, item in items:
            if item.shape[1:] != first.shape[1:] or item.dtype != first.dtype:
                raise CheckpointError(f"{link.shards[rank]}: table {table!r} {name} is {item.dtype} "
                                      f"{list(item.shape)}, another shard's is {first.dtype} {list(first.shape)}")
            for start, chunk in stream_array(link.shards[rank], item, f"table {table!r} {name}"):
                kept = chunk if mask is None else chunk[mask[start:start + len(chunk)]]
                array[at:at + len(kept)] = kept
                at += len(kept)
                done += len(kept)
                if progress is not None and name not in PENDING:
                    progress(done, total_rows * len([n for n in names if n not in PENDING]))
        out[name] = array
    return out
