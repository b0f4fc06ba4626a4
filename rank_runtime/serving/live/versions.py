"""Served versions: a session of the model graph at one checkpoint, and the two ways to reach the
next one. A delta that builds on the version served is applied in place: its rows are read and
checked, its keys' rows found and new rows chosen while requests go on, then one `session.run`
under the version's write lock writes them (changed rows, new and removed keys, the dense
variables), so that a request runs wholly before or wholly after it. Anything else (a full save,
a chain the server did not follow, the first load) builds a new session from the chain and swaps
it in; the old one closes once its requests are done."""
import copy
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from ...formats.checkpoint_chain import Link, read_chain_table, table_keys
from ...formats.manifest import DELTA, SaveRef
from ...formats.sparse_checkpoint import CheckpointError
from ..saved_rows import saved_tables
from .model_graph import ModelGraph
from .row_slots import RowSlots
from .rw_lock import ReadWriteLock


class Retired(Exception):
    """The version was replaced while the request waited: run it on the current one."""


@dataclass(frozen=True)
class VersionInfo:
    """What a version serves: TF Serving's version number (the checkpoint's step), the checkpoint,
    the save a delta must build on to apply in place, and when it was committed and served."""
    number: int
    checkpoint: str
    saved_as: Optional[SaveRef]
    committed_at: float
    served_at: float


def _committed_at(path: str) -> float:
    """A save is listed once its dense part is written, after every shard: its .index's time."""
    try:
        return os.stat(f"{path}.index").st_mtime
    except OSError:
        return time.time()


class ServedVersion:
    def __init__(self, graph: ModelGraph, session, info: VersionInfo, slots: dict):
        self.graph, self.session, self.info, self.slots = graph, session, info, slots
        self.lock = ReadWriteLock()
        self.closed = False
        self.damaged = False

    def run(self, fetches: Any, feeds: dict) -> tuple:
        """(session.run's result, the VersionInfo it was computed at)."""
        with self.lock.reading():
            if self.closed or self.damaged:
                raise Retired()
            return self.session.run(fetches, feeds), self.info

    def retire(self) -> None:
        with self.lock.writing():
            self.closed = True
            self.session.close()


def _dense_feeds(graph: ModelGraph, save_path: str) -> dict:
    reader = tf.train.load_checkpoint(save_path)
    missing = [name for name in graph.dense if not reader.has_tensor(name)]
    if missing:
        raise CheckpointError(f"{save_path}: has no dense variable(s) {missing} that the served model has")
    return {value: reader.get_tensor(name) for name, (value, _) in graph.dense.items()}


def load_version(graph: ModelGraph, save_path: str) -> ServedVersion:
    """A new session at the checkpoint `save_path` (a full save, or a delta with its chain)."""
    saved = saved_tables(save_path)
    sess = graph.new_session()
    try:
        slots = {}
        for name, ops in graph.tables.items():
            table = saved.tables.get(name)
            if table is None or table.dim != ops.layout.dim:
                have = {n: t.dim for n, t in saved.tables.items()}
                raise CheckpointError(f"{save_path}: the served model has table {name!r} of dim {ops.layout.dim}; "
                                      f"the checkpoint's tables (name: dim) are {have}")
            zero, n = ops.layout.zero_row, table.rows
            rows, capacity = RowSlots.first_fill(zero, n)
            arrays = read_chain_table(saved.links, name, ("keys", "values"), extra_rows=capacity - n)
            values = arrays["values"]
            if n > zero:  # the key read into the zero row moves to the end (first_fill)
                values[n] = values[zero]
                values[zero] = 0
            sess.run(ops.assign, {ops.all_values: values})
            sess.run(ops.update, _update_feeds(ops, rows[:0], values[:0], arrays["keys"][:n], rows, []))
            slots[name] = RowSlots(zero, capacity, rows)
        dense = _dense_feeds(graph, saved.save_path)
        sess.run([op for _, op in graph.dense.values()], dense)
    except BaseException:
        sess.close()
        raise
    last = saved.links[-1]
    info = VersionInfo(last.step or 0, saved.save_path, SaveRef(os.path.basename(last.path), last.step, last.save_id),
                       _committed_at(saved.save_path), time.time())
    return ServedVersion(graph, sess, info, slots)


def _update_feeds(ops, rows, values, insert_keys, insert_rows, remove_keys) -> dict:
    return {ops.rows: rows, ops.rows_values: values, ops.insert_keys: insert_keys,
            ops.insert_rows: np.asarray(insert_rows, np.int64), ops.remove_keys: np.asarray(remove_keys, np.int64)}


def builds_on(link: Link, version: ServedVersion) -> bool:
    """Whether `link` is a delta on exactly the save that `version` serves."""
    return link.kind == DELTA and version.info.saved_as is not None and link.previous == version.info.saved_as


def apply_delta(version: ServedVersion, link: Link) -> VersionInfo:
    """Applies the delta `link` to `version` in place; reads and checks everything first, so that a
    damaged delta raises CheckpointError with the version untouched."""
    graph, sess = version.graph, version.session
    feeds, grows, planned = {}, [], {name: copy.copy(slots) for name, slots in version.slots.items()}
    for name, ops in graph.tables.items():
        arrays = read_chain_table([link], name, ("keys", "values"))
        keys, values = arrays["keys"].astype(np.int64, copy=False), arrays["values"]
        if values.shape[1:] != (ops.layout.dim,):
            raise CheckpointError(f"{link.path}: table {name!r} rows are {list(values.shape[1:])}, the served "
                                  f"model's dim is {ops.layout.dim}")
        removed = np.asarray(table_keys([link], name)[1][0], np.int64)
        removed = removed[~np.isin(removed, keys)]
        slots = planned[name]
        rows = graph.find_rows(sess, name, keys)
        new = rows == slots.zero_row
        removed_rows = graph.find_rows(sess, name, removed)
        held = removed_rows != slots.zero_row
        before = slots.capacity
        rows[new], capacity = slots.take(int(new.sum()), removed_rows[held])
        if capacity > before:
            grows.append((ops.grow, {ops.grow_to: capacity}))
        feeds.update(_update_feeds(ops, rows, values, keys[new], rows[new], removed[held]))
    feeds.update(_dense_feeds(graph, link.path))
    info = VersionInfo(link.step or 0, link.path, SaveRef(os.path.basename(link.path), link.step, link.save_id),
                       _committed_at(link.path), 0.0)
    updates = [ops.update for ops in graph.tables.values()] + [op for _, op in graph.dense.values()]
    # Growing writes the same rows into a larger variable (new rows are zeros no key reads): a
    # request reads the same before and after, so it does not wait for the write lock.
    for op, feed in grows:
        sess.run(op, feed)
    with version.lock.writing():
        try:
            sess.run(updates, feeds)
        except BaseException:
            version.damaged = True  # part of the update may be in: the follower loads the save afresh
            raise
        version.slots = planned
        version.info = VersionInfo(info.number, info.checkpoint, info.saved_as, info.committed_at, time.time())
    return version.info
