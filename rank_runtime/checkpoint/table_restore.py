"""Restoring tables from a checkpoint's shards (sparse_checkpoint.py), for the Saver and warm start.

Steps, with agreement rounds between them (restore_tables(), which the Saver and warm start call):

1. plan(): the manifests and layouts checked against the graph's tables, the keys and admission
   arrays read and verified, capacities checked. No row file is read yet. An incremental
   checkpoint's chain (checkpoint_chain.py) is planned as one: each key's rows come from the newest
   save of the chain that holds it.
2. verify(): every row file (values, optimizer slots) read through once, its size, header and
   CRC-32 checked, a chunk at a time. No row is written: a damaged checkpoint leaves every table as
   it was, on every rank. Meanwhile a table that held no keys gets its keys placed (the key index,
   rebuilt while the disk reads), which withdraw() takes back on a refusal.
3. load(): each table cleared and its rows streamed in, a chunk at a time, from the file into the
   row store or straight into the SSD tier (the second read comes from the page cache when the
   files fit in it). No table passes through memory whole, so a table that trains within its
   memory budget restores within it.
4. reset(), on every rank, when a load failed on any rank (an I/O error after the verification):
   every table back to its initializer.

Files are read side by side (_STREAMS threads): the disk reads ahead in one while another's chunk
is checksummed or copied.
"""
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from tensorflow.python.checkpoint import checkpoint_management

from ..process import config
from ..formats.checkpoint_chain import resolve, surviving, table_keys
from ..process.logs import get_logger
from .rank_agreement import agree, attempt
from ..embedding.row_store import MEMORY_LIMIT_ENV
from ..formats.sparse_checkpoint import CheckpointError, needed_shards, sparse_dir
from ..formats.manifest import ADMISSION_ARRAYS, PENDING, TableEntry
from ..formats.array_files import map_array, read_array, stream_array
from ..formats.sharding_plan import ROW_WISE

log = get_logger("shardrec.restore")
# Files streamed side by side: the disk reads ahead in one while another's chunk is checksummed.
_STREAMS = 3
_MIN_CHUNK, _MAX_CHUNK = 2**20, 64 * 2**20


@dataclass
class ShardPart:
    """One saved shard's part of this rank's table: its folder, the manifest's table entry, and
    which of its rows this rank takes (None: all): those of keys it owns under this world size,
    and in a chain those that no later save replaced or removed."""
    shard_dir: str
    entry: TableEntry
    mine: np.ndarray = None


@dataclass
class TablePlan:
    """What load() puts into one table: this rank's keys (the parts' owned keys, in order), the
    columns to stream, and the admission state (None: the table does not count)."""
    table: object
    parts: list
    keys: np.ndarray
    columns: list
    admission: dict = None
    used: bool = False  # the table held keys before this restore: it starts again from its initializer
    locations: np.ndarray = None  # each key's row (or SSD record), given by load()


def plan(save_path: str, tables: list, values_only: bool = False, check_dense: bool = False) -> list:
    """[TablePlan] for `tables` from the checkpoint at `save_path` (a full save, or the end of a
    chain of deltas), the keys this rank owns read and verified. values_only (warm start): the rows
    of values alone; optimizer slots start afresh. check_dense: also check that the dense part of
    the checkpoint is there."""
    cfg = config.get_config()
    if check_dense and not checkpoint_management.checkpoint_exists_internal(save_path):
        raise CheckpointError(f"{save_path}: the dense part of the checkpoint ({save_path}.index) is missing")
    # A table placed other than row-wise, now or when saved, takes its keys from every shard.
    every = any(t.placement.kind != ROW_WISE for t in tables)
    links = resolve(save_path, lambda root: needed_shards(root, cfg.rank, cfg.size, every))
    if not every and _placed_otherwise(links, [t.table_name for t in tables]):
        links = resolve(save_path, lambda root: needed_shards(root, cfg.rank, cfg.size, True))
    return [_plan_table(save_path, table, links, values_only) for table in tables]


def _placed_otherwise(links, names) -> bool:
    """Whether a save of the chain kept one of the tables `names` other than row-wise."""
    for link in links:
        for manifest in link.manifests.values():
            for name in names:
                entry = manifest.tables.get(name)
                if entry is not None and entry.sharding is not None and entry.sharding.placement.kind != ROW_WISE:
                    return True
    return False


def _plan_table(save_path, table, links, values_only):
    cfg = config.get_config()
    name = table.table_name
    for link in links:
        for r, shard in sorted(link.shards.items()):
            entry = link.manifests[r].tables.get(name)
            if entry is None:
                raise CheckpointError(f"{shard}/MANIFEST.json: has no table {name!r}; it has "
                                      f"{sorted(link.manifests[r].tables)}")
            _check_layout(os.path.join(shard, "MANIFEST.json"), table, entry, values_only)
    saved_keys, removed = table_keys(links, name)
    masks = surviving(saved_keys, removed)
    # Keys from other ranks' shards too (another world size, or a placement): keep this rank's.
    resharded = sorted(links[0].shards) != [cfg.rank] or links[0].world_size != cfg.size
    placement = table.placement
    parts, keys = [], []
    for link, link_keys, link_masks in zip(links, saved_keys, masks):
        for (r, shard), part, survives in zip(sorted(link.shards.items()), link_keys, link_masks):
            entry = link.manifests[r].tables[name]
            part = part.astype(np.int64, copy=False)
            if len(part) != entry.rows:
                raise CheckpointError(f"{shard}/{name}/keys.npy: {len(part)} keys, but the manifest says rows = "
                                      f"{entry.rows}")
            mine = placement.holds(part, cfg.rank, cfg.size) if resharded else None
            mine = survives if mine is None else (mine if survives is None else mine & survives)
            keys.append(part if mine is None else part[mine])
            parts.append(ShardPart(shard, entry, mine))
    keys = _joined(keys)
    admission = _admission_of(table, links, parts, cfg, len(keys))
    store = table.store
    if table.expands and len(keys) * store.bytes_per_row > store.memory_limit:
        raise CheckpointError(f"{sparse_dir(save_path)}: table {name!r} has {len(keys)} keys for rank "
                              f"{cfg.rank}: {len(keys) * store.bytes_per_row} bytes of rows, over its memory limit "
                              f"of {store.memory_limit} bytes; raise {MEMORY_LIMIT_ENV}")
    if len(keys) > table.max_rows():
        raise CheckpointError(f"{sparse_dir(save_path)}: table {name!r} has {len(keys)} keys for rank "
                              f"{cfg.rank}, more than its capacity {table.max_rows()}; raise "
                              "device_vocabulary_size" + (f" or {MEMORY_LIMIT_ENV}" if table.expands else ""))
    columns = ["values"] + ([] if values_only else sorted(table.slots))
    _say_conversions(table, parts[0].entry if parts else None, columns)
    used = table.index.size() > 0 or table.index.counters().inserted > 0
    return TablePlan(table, parts, keys, columns, admission, used)


def _files(plans):
    """(plan, column, its parts' (part, manifest file entry)) for every row file to stream."""
    for p in plans:
        for column in p.columns:
            yield p, column, [(part, part.entry.files[column]) for part in p.parts]


def _streamed(p, column, files, sink=None, verified=False):
    """Streams one column of one table, each chunk's owned rows to sink(position in p.keys, rows)
    (None: read through to check it); verified: the files were checked before (verify()), read
    them through a mapping."""
    name = p.table.table_name
    at = 0
    for part, entry in files:
        if entry.shape != (part.entry.rows, p.table.dim):
            raise CheckpointError(f"{part.shard_dir}/{entry.file}: {list(entry.shape)} rows, but "
                                  f"{part.entry.rows} keys of dim {p.table.dim}")
        reader = map_array if verified else stream_array
        for first, rows in reader(part.shard_dir, entry, f"table {name!r} {column}", _chunk_bytes(p.table)):
            if sink is None:
                continue
            if part.mine is not None:
                rows = rows[part.mine[first:first + len(rows)]]
            if p.table.row_dim != p.table.dim:  # a column-wise table's slice: its columns of whole rows
                rows = np.ascontiguousarray(rows[:, p.table.held_columns])
            sink(at, rows)
            at += len(rows)


def _chunk_bytes(table) -> int:
    """A chunk of a table's row file: the streams side by side hold at most a tenth of the table's
    rows in memory (its budget, for a tiered table; 1 to 64 MiB), so that a table mostly on SSD
    restores within its budget."""
    in_memory = table.capacity() * table.dim * 4 * len(table.columns)
    return min(_MAX_CHUNK, max(_MIN_CHUNK, in_memory // (10 * _STREAMS)))


def _each_file(plans, work, meanwhile=lambda: None):
    with ThreadPoolExecutor(max_workers=_STREAMS) as pool:
        running = [pool.submit(work, *f) for f in _files(plans)]
        meanwhile()
        for done in running:
            done.result()


def verify(sess: Any, plans: list) -> None:
    """Reads every row file of `plans` through, checking it, and meanwhile gives the keys of each
    table that held none their rows (the key index alone is filled, no row is written: withdraw()
    empties it again should the checkpoint be refused)."""
    def place_fresh():
        for p in plans:
            if not p.used:
                _prepare(sess, p)

    try:
        _each_file(plans, _streamed, place_fresh)
    except BaseException:
        withdraw(plans)
        raise


def withdraw(plans: list) -> None:
    """Undoes what verify() did to fresh tables: their key index empty again."""
    for p in plans:
        if p.locations is not None and not p.used:
            p.table.index.clear()
            p.locations = None


def load(sess: Any, plans: list) -> None:
    """Streams the rows of every table in (see the module doc); the caller resets on failure."""
    for p in plans:
        if p.locations is None:
            _prepare(sess, p)

    def load_column(p, column, files):
        table = p.table
        c = table.columns[column]
        if table.ssd is not None:  # memory first, the rest straight to SSD (placed by _prepare)
            _streamed(p, column, files, lambda at, rows: table.index.write_rows(
                c, p.keys[at:at + len(rows)], p.locations[at:at + len(rows)], rows), verified=True)
        else:
            _streamed(p, column, files, lambda at, rows: table.store.write_rows(
                c, p.locations[at:at + len(rows)], rows), verified=True)

    _each_file(plans, load_column)
    for p in plans:
        if p.admission is not None:
            index, a = p.table.index, p.admission
            index.write_metadata(p.locations, np.ascontiguousarray(a["counts"], np.uint32),
                                 np.ascontiguousarray(a["last_seen"], np.int64))
            index.import_pending(*(np.ascontiguousarray(a[name]) for name in PENDING))
            index.newest = a["newest"]
    log.info("restored this rank's keys of %d table(s): %s", len(plans),
             ", ".join(f"{p.table.table_name}={p.table.size()}" for p in plans))


def _prepare(sess, p):
    """Empties the table and gives its keys their rows. A table that has held keys in this session
    starts again from its initializer, so that keys inserted after the restore do not inherit rows
    of keys that were dropped. A fresh table keeps the values its initializer gave it: re-running a
    random initializer would draw other values, and a resumed run would then differ from an
    uninterrupted one."""
    table = p.table
    ops = table.init_ops()
    done = sess.run(ops.initialized)
    sess.run([init for init, ok in zip(ops.initializers, done) if p.used or not ok])
    table.index.clear()
    keys = np.ascontiguousarray(p.keys, np.int64)
    p.locations = table.index.place(keys) if table.ssd is not None else table.index.lookup(keys, allocate=True)


def reset(sess: Any, tables: list) -> None:
    """After a failed load: every table empty, its rows and slots at their initializers' values
    (a random initializer draws anew)."""
    for table in tables:
        table.index.clear()
        sess.run(table.init_ops().initializers)


def _check_layout(manifest_path, table, entry, values_only):
    """A manifest's table against the graph's table: dim, key dtype, optimizer slots."""
    problems = []
    if entry.dim != table.dim:
        problems.append(f"dim {entry.dim} (this graph: {table.dim})")
    if entry.key_dtype != table.key_dtype.name:
        problems.append(f"key dtype {entry.key_dtype} (this graph: {table.key_dtype.name})")
    # A graph without optimizer (evaluation, prediction) restores the values alone.
    if values_only:
        pass
    elif table.optimizers and entry.optimizers != sorted(table.optimizers):
        problems.append(f"optimizer(s) {entry.optimizers} (this graph: {sorted(table.optimizers)})")
    elif table.optimizers and entry.slots != sorted(table.slots):
        problems.append(f"optimizer slots {entry.slots} (this graph: {sorted(table.slots)})")
    if problems:
        raise CheckpointError(f"{manifest_path}: table {table.table_name!r} was saved with " + ", ".join(problems)
                              + "; restore it into a graph with the same table and optimizer")


def _say_conversions(table, entry, columns):
    """Logs the columns a checkpoint holds in another dtype than this job's table (float32 rows into
    a 16-bit table, or 16-bit rows into a float32 one): the restore converts them, each to the nearest."""
    if entry is None:
        return
    for column in columns:
        saved, held = entry.files[column].dtype, table.store.column_dtype(table.columns[column])
        if saved != held:
            log.warning("table %r: the checkpoint holds %s as %s, this job as %s: converted on restore (to the "
                        "nearest)", table.table_name, column, saved, held)


def _admission_files(manifest_path, table, entry):
    """The admission arrays to read for `table` from a shard's manifest entry (none when the table
    does not count, or the checkpoint has none). A damaged entry is a CheckpointError, which every
    rank learns of, not a KeyError on one rank while the others wait for it (read_manifest checked
    the entry's types)."""
    if table.thresholds is None or not table.thresholds.counts or entry.admission is None:
        return []
    names = list(ADMISSION_ARRAYS)
    if any(n not in entry.files for n in names):
        raise CheckpointError(f"{manifest_path}: table {table.table_name!r} has a damaged admission entry (it needs "
                              f"the files {names}); the checkpoint cannot be restored")
    return names


def _admission_of(table, links, parts, cfg, n_keys):
    """The counts and timestamps of this rank's keys (from each part's rows it takes, in the order
    of its keys) and its pending keys and the newest timestamp (the chain's last save), or None
    when the table does not count."""
    if table.thresholds is None or not table.thresholds.counts:
        return None
    name = table.table_name
    last = links[-1]
    entries = [last.manifests[r].tables[name] for r in sorted(last.shards)]
    if any(part.entry.admission is None for part in parts) or any(e.admission is None for e in entries):
        log.warning("table %r counts keys for admission, but the checkpoint holds no counts or timestamps for it: its "
                    "%d key(s) are restored as admitted, with count 0 and last-seen timestamp 0", name, n_keys)
        return {"counts": np.zeros(n_keys, np.uint32), "last_seen": np.zeros(n_keys, np.int64),
                **{p: np.zeros(0, d) for p, d in zip(PENDING, (np.int64, np.uint32, np.int64))}, "newest": -1}
    out = {"newest": max(e.admission.newest for e in entries)}
    for part in parts:
        path = os.path.join(part.shard_dir, "MANIFEST.json")
        _admission_files(path, table, part.entry)
        for array_name in ("counts", "last_seen"):
            array = read_array(part.shard_dir, part.entry.files[array_name], f"table {name!r} {array_name}")
            if array.shape[0] != part.entry.rows:
                raise CheckpointError(f"{path}: table {name!r}: {array_name}.npy holds {array.shape[0]} entries for "
                                      f"{part.entry.rows} keys")
            out.setdefault(array_name, []).append(array if part.mine is None else array[part.mine])
    for r, shard in sorted(last.shards.items()):
        entry = last.manifests[r].tables[name]
        _admission_files(os.path.join(shard, "MANIFEST.json"), table, entry)
        pending = {p: read_array(shard, entry.files[p], f"table {name!r} {p}") for p in PENDING}
        if any(a.shape != pending["pending_keys"].shape for a in pending.values()):
            raise CheckpointError(f"{shard}: table {name!r}: its pending arrays differ in length")
        resharded = sorted(last.shards) != [cfg.rank] or last.world_size != cfg.size
        mine = table.placement.holds(pending["pending_keys"], cfg.rank, cfg.size) if resharded else slice(None)
        for p, array in pending.items():
            out.setdefault(p, []).append(array[mine])
    return {k: (_joined(v) if isinstance(v, list) else v) for k, v in out.items()}


def _joined(parts):
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def restore_tables(sess: Any, sources: Any, what: str, values_only: bool = False,
                   check_dense: bool = False) -> None:
    """Restores the tables of `sources`, [(checkpoint path, [tables])]. Every
    rank plans its part, then verifies its row files, and all agree after each: a damaged or
    missing file on any rank leaves every table as it was, on every rank. Then every rank streams
    its rows in; should that still fail (an I/O error), every rank's tables are reset."""
    tables = [t for _, group in sources for t in group]
    plans = attempt(lambda: [p for path, group in sources for p in plan(path, group, values_only, check_dense)])
    agree(what, plans, "nothing was loaded on any rank")
    checked = attempt(lambda: verify(sess, plans.value))
    try:
        agree(what, checked, "nothing was loaded on any rank")
    except CheckpointError:
        withdraw(plans.value)
        raise
    loaded = attempt(lambda: load(sess, plans.value))
    try:
        agree(what, loaded, "every rank's tables are back at their initial state")
    except CheckpointError:
        reset(sess, tables)
        raise
