"""Per-rank sparse checkpoint files: one directory per shard, committed by its manifest.

    <dir>/sparse-<name>-<step>/rank-<r>-of-<n>/MANIFEST.json
    <dir>/sparse-<name>-<step>/rank-<r>-of-<n>/<table>/keys.npy, values.npy, <optimizer>.<slot>.npy
    and, for a table with admission: counts.npy (uint32), last_seen.npy (int64), aligned with keys;
    pending_keys.npy, pending_counts.npy, pending_last_seen.npy (keys still counting, no row); the
    manifest's table entry then has "admission": {access_threshold, eviction_threshold, newest,
    pending_rows}.

An incremental checkpoint (init(is_incremental_checkpoint=True)) is a chain: a full save, whose
manifest says "kind": "full", then deltas ("kind": "delta"), each holding only the rows that
changed since the save before it (keys.npy and the arrays aligned with it), the keys removed since
(removed.npy, "removed_rows" in the table entry) and the whole of the pending keys. Every save has a
"save_id" shared by its shards; a delta names its "previous" save and its "base" (the full save) by
name, step and save_id, so that a chain with a missing, replaced or damaged link is refused
(checkpoint_chain.py reads chains). A manifest without "kind" is a full save.

Each rank writes its own shard directory, so no rank waits for another: the files go into a
temporary directory, are flushed, the manifest (sizes, CRC-32s, shapes, dims, slot names, step,
world size) is written last, and the directory is renamed into place. A shard directory without a
valid manifest does not exist for restore. A save's shards are committed into a staging directory
(<dir>/.sparse-<name>.saving), which replaces sparse-<name> as a whole once every rank committed
(publish()): a step saved again by another number of ranks (a job restarted on fewer ranks that
saves the step it restored) leaves no shard of the old world size beside the new ones, and a save
killed before that leaves the old sparse-<name> as it was. Arrays are .npy files (a small header and raw data),
read with allow_pickle=False: nothing in a checkpoint can execute.

A checkpoint of n ranks restores into any number of ranks: each rank keeps the keys it owns
under the new world size (owner = key mod world size, as in the key exchange).

This module is the one description of the format: the Saver writes and reads through it, and
the supervisor's tools (orchestrator/checkpoints.py, shardrec-ckpt) read through it. It imports
no TensorFlow.
"""
import ctypes
import dataclasses
import errno
import json
import os
import re
import shutil
from typing import Any, Dict, Optional, Tuple

from ..process.logs import get_logger
from .array_files import MANIFEST, CheckpointError, checked_size, crc_of, file_of
from .manifest import FULL, PER_RANK, SHARED, SaveKind, ShardManifest
from .stream_positions import StreamPositions

log = get_logger("shardrec.checkpoint")

SHARD_RE = re.compile(r"rank-(\d+)-of-(\d+)")
SPARSE_RE = re.compile(r"sparse-(.+)")
STAGING_SUFFIX = ".saving"
STAGING_RE = re.compile(r"\.sparse-(.+)\.saving")


def sparse_dir(save_path: str) -> str:
    """The sparse directory that belongs to a dense checkpoint path `<dir>/<name>-<step>`."""
    head, tail = os.path.split(os.path.abspath(save_path))
    return os.path.join(head, f"sparse-{tail}")


def staging_dir(save_path: str) -> str:
    """Where a save of `save_path` commits its shards before publish() puts them in place; its name
    starts with a dot and does not match SPARSE_RE, so no reader takes it for a checkpoint."""
    head, tail = os.path.split(os.path.abspath(save_path))
    return os.path.join(head, f".sparse-{tail}{STAGING_SUFFIX}")


def shard_name(rank: int, size: int) -> str:
    return f"rank-{rank}-of-{size}"


def _fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root):
    """Flushes every file under `root`, then its directories, deepest first. Written first and
    flushed together, a shard's files cost the disk one journal commit, not one per file (a delta's
    dozen small files; bench/README.md, "Incremental checkpoints")."""
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync_path(os.path.join(directory, name))
        _fsync_path(directory)


def admission_arrays(state: Any) -> dict:
    """A table's admission arrays by file name, from the native core's IndexState of a save: the
    one place that pairs the files with the state's fields."""
    return {"counts": state.counts, "last_seen": state.last_seen, "pending_keys": state.pending.keys,
            "pending_counts": state.pending.counts, "pending_last_seen": state.pending.last_seen}


def write_shard(save_path: str, rank: int, size: int, step: int | None, tables: dict, shared: bool,
                kind: Optional[SaveKind] = None, stream: Optional[StreamPositions] = None) -> str:
    """tables: {table name: writer}, a writer being a function that writes the table's arrays into
    the folder it is given and returns their TableFiles (the Saver's write rows straight from the
    row store, so that no table passes through memory whole).
    shared: every rank saves under the same path (else each under its own, the user guide's
    `model-{rank_id}`). kind: a full save or a delta (None: a full save of a job without
    incremental checkpoints). stream: the positions of the stream partitions this rank read
    (stream/). Returns the committed shard directory, in the save's staging
    directory: publish() puts it in place once every rank committed."""
    root = staging_dir(save_path)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, shard_name(rank, size))
    tmp = os.path.join(root, f".tmp-{shard_name(rank, size)}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    entries = {}
    try:
        for name, write in tables.items():
            folder = os.path.join(tmp, name)
            os.makedirs(folder)
            entry = write(folder)
            entries[name] = dataclasses.replace(entry, files={k: v.moved_into(name) for k, v in entry.files.items()})
        kind = kind or SaveKind(FULL, None)
        manifest = ShardManifest(step, rank, size, SHARED if shared else PER_RANK, entries, kind.kind, kind.save_id,
                                 kind.base, kind.previous, stream)
        _fsync_tree(tmp)  # every file on disk before the manifest that commits them
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest.to_json(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed save (a full disk) leaves no half shard behind
        raise
    # A shard of the same step written before (a repeated save) is replaced as a whole.
    move_into_place(tmp, final)
    _fsync_path(root)
    return final


def publish(save_path: str, size: int) -> str:
    """Puts the staged shards of a save of `size` ranks in place as sparse-<name>, replacing what
    was there as a whole. Call once every rank committed its shard, on one rank per directory (rank
    0 when every rank saves under the same path): nothing else writes the staging directory then,
    so whatever it holds besides this save's shards (shards of another world size, temporary
    directories of a killed save) is a leftover and goes."""
    staging, live = staging_dir(save_path), sparse_dir(save_path)
    for entry in os.listdir(staging):
        m = SHARD_RE.fullmatch(entry)
        if m is None or int(m.group(2)) != size:
            path = os.path.join(staging, entry)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    move_into_place(staging, live)
    _fsync_path(os.path.dirname(live))
    return live


def discard_staged(save_path: str) -> None:
    """Removes a failed save's staging directory (once no rank writes it any more)."""
    shutil.rmtree(staging_dir(save_path), ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swaps two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the C library
    or the filesystem cannot (NFS, say)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), f"{a} <-> {b}")


def move_into_place(tmp: str, final: str) -> None:
    """Renames the finished directory `tmp` to `final`; a directory already at `final` is replaced
    as a whole, never merged: swapped with `tmp` in one step where the filesystem can, else moved
    aside first; then removed."""
    if os.path.exists(final) and _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)
    elif os.path.exists(final):
        old = f"{final}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def read_manifest(shard_dir: str) -> ShardManifest:
    """The manifest of one committed shard, validated (manifest.py); a CheckpointError names what is wrong."""
    path = os.path.join(shard_dir, MANIFEST)
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the shard was never committed (a save that did not finish)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a valid manifest ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a valid manifest (not an object)")
    manifest = ShardManifest.from_json(raw, path)
    m = SHARD_RE.fullmatch(os.path.basename(os.path.normpath(shard_dir)))
    if not m or (int(m.group(1)), int(m.group(2))) != (manifest.rank, manifest.world_size):
        raise CheckpointError(f"{path}: says rank {manifest.rank} of {manifest.world_size}, "
                              f"but lies in {os.path.basename(shard_dir)!r}")
    return manifest


def find_shards(root: str) -> Tuple[Dict[int, str], int]:
    """{rank: shard directory} of the committed shards under a sparse directory, and the world
    size they were written by."""
    if not os.path.isdir(root):
        raise CheckpointError(_no_sparse_dir(root))
    shards, sizes = {}, set()
    for entry in sorted(os.listdir(root)):
        m = SHARD_RE.fullmatch(entry)
        if m and os.path.exists(os.path.join(root, entry, MANIFEST)):
            shards[int(m.group(1))] = os.path.join(root, entry)
            sizes.add(int(m.group(2)))
    if not shards:
        raise CheckpointError(f"{root}: no committed shard (no rank-<r>-of-<n>/{MANIFEST})")
    if len(sizes) > 1:
        raise CheckpointError(f"{root}: shards of different world sizes {sorted(sizes)} "
                              f"({', '.join(e for e in sorted(os.listdir(root)) if SHARD_RE.fullmatch(e))}): a save "
                              "by another number of ranks (of an older shardrec) did not replace the old ones; "
                              "remove the shards of the world size that did not write this step last")
    return shards, sizes.pop()


def _no_sparse_dir(root: str) -> str:
    """Why `root` holds no checkpoint; for a dense path that is a model directory, which
    checkpoints it does hold."""
    head, tail = os.path.split(root)
    dense = os.path.join(head, m.group(1)) if (m := SPARSE_RE.fullmatch(tail)) else root
    if os.path.isdir(dense):
        names = sorted(m.group(1) for e in os.listdir(dense) if (m := SPARSE_RE.fullmatch(e)))
        held = f"it holds the checkpoint(s) {', '.join(names)}" if names else "it holds no shardrec checkpoint"
        return (f"{dense} is a directory, not a checkpoint prefix: {held}; restore one of them by its prefix "
                f"(<dir>/<name>), e.g. tf.train.latest_checkpoint({dense!r})")
    return f"{root}: no sparse checkpoint here (the directory does not exist)"


def needed_shards(root: str, rank: int, size: int, every: bool = False) -> tuple:
    """(the shards this rank reads to restore from `root` into a world of `size`, {rank: dir},
    the world size that wrote it). every: all of them (tables placed other than row-wise, now or
    when saved, keep keys of any shard). Raises CheckpointError when one is missing."""
    shards, saved_size = find_shards(root)
    shared = read_manifest(next(iter(shards.values()))).shared
    if not shared and (saved_size != size or every):
        raise CheckpointError(f"{root}: written by {saved_size} ranks each under its own path; such a checkpoint "
                              f"restores into {saved_size} ranks only, each table placed row-wise (this job has "
                              f"{size} ranks{', and a table placed otherwise, now or when saved' if every else ''}). "
                              "To change the number of ranks or a placement, save with the same path on every rank")
    # The same world reads its own shard; another world size reads them all and keeps its keys.
    needed = [rank] if saved_size == size and not every else list(range(saved_size))
    missing = [r for r in needed if r not in shards]
    if shared and not missing:
        missing = [r for r in range(saved_size) if r not in shards]
    if missing:
        raise CheckpointError(f"{root}: the shards of rank(s) {missing} of {saved_size} are missing (no committed "
                              f"{shard_name(missing[0], saved_size)}/{MANIFEST}); the save did not finish on "
                              "every rank")
    return {r: shards[r] for r in needed}, saved_size


def verify_shard(shard_dir: str, checksums: bool = True) -> tuple:
    """(the manifest or None, the list of problems) of one committed shard, reading each file in
    chunks: sizes, CRC-32s (unless checksums=False), and row counts that agree with `rows`."""
    try:
        manifest = read_manifest(shard_dir)
    except CheckpointError as e:
        return None, [str(e)]
    problems = []
    for table, entry in sorted(manifest.tables.items()):
        for name, item in sorted(entry.files.items()):
            rows = entry.rows_of(name)
            what = f"table {table!r} {name}"
            try:
                path = file_of(shard_dir, item, what)
                checked_size(path, item, what)
                if checksums and crc_of(path) != item.crc32:
                    raise CheckpointError(f"{path}: checksum mismatch ({what}); the file is corrupt")
                if not item.shape or item.shape[0] != rows:
                    raise CheckpointError(f"{path}: holds {list(item.shape)} rows, but the manifest says rows = "
                                          f"{rows} for table {table!r}")
            except CheckpointError as e:
                problems.append(str(e))
    return manifest, problems
