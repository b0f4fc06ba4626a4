"""A table's storage tiers as the table sees them (create_table's device, host and SSD vocabulary).

On a CPU host the device and host tiers are both this process's memory: their sum, shared over the
ranks, is the table's memory budget, rows the kernels read directly. The SSD tier
(ssd_vocabulary_size > 0) is files the native core owns under ssd_data_path (native/src/storage/ssd_tier.h);
a lookup brings its batch's rows into memory before the batch's step and moves the coldest rows
not in flight down when memory is full (native/src/storage/residency.h). Where TensorFlow sees a GPU the
device tier would be GPU memory above the host tier; shardrec's tables stay in host memory today.
"""
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import psutil

from ..process.logs import get_logger, warn_once
from ..validation import check_type

log = get_logger("shardrec.tiers")

SWAP_POLICY_ENV = "SHARDREC_SWAP_POLICY"
# Measured on the benchmark's Zipf keys (bench/README.md, "Issue 14's target"): see swap_policy().
DEFAULT_POLICY = "lfu"
_OWN_DIR = re.compile(r"shardrec-ssd-(?P<table>.+)-rank(?P<rank>\d+)-pid(?P<pid>\d+)-\d+")


def swap_policy() -> str:
    """Which rows move to SSD first: 'lfu' (least frequently used; the default, measured better on
    Zipf keys) or 'lru', from SHARDREC_SWAP_POLICY."""
    policy = os.environ.get(SWAP_POLICY_ENV, DEFAULT_POLICY).strip().lower() or DEFAULT_POLICY
    if policy not in ("lru", "lfu"):
        raise ValueError(f"{SWAP_POLICY_ENV}={policy!r} is not a swap policy; allowed: 'lfu' (least frequently used) "
                         "or 'lru' (least recently used)")
    return policy


def ssd_paths(owner: str, name: str, ssd_data_path: Any, ssd_vocabulary_size: int) -> tuple:
    """The checked directories of the SSD tier (the Rec SDK's default: the working directory)."""
    if ssd_data_path is None:
        paths = (os.getcwd(),)
    else:
        paths = (ssd_data_path,) if isinstance(ssd_data_path, str) else ssd_data_path
        check_type(owner, "ssd_data_path", paths, (list, tuple), "a list of directory paths")
        if not paths:
            raise ValueError(f"{owner}: parameter 'ssd_data_path' is empty; allowed: one or more directories")
        for p in paths:
            check_type(owner, "ssd_data_path", p, str, "a list of directory paths")
        if ssd_vocabulary_size == 0:
            warn_once(f"create_table({name!r}): ssd_data_path has no effect with ssd_vocabulary_size=0 (no SSD tier)",
                      "shardrec.table")
            return tuple(paths)
    if ssd_vocabulary_size == 0:
        return tuple(paths)
    for p in paths:
        if not os.path.isdir(p):
            raise ValueError(f"{owner}: ssd_data_path entry {p!r} is not a directory; allowed: existing directories "
                             "this process may write to")
        if not os.access(p, os.W_OK | os.X_OK):
            raise PermissionError(f"{owner}: ssd_data_path entry {p!r} is not writable by this process; allowed: "
                                  "existing directories this process may write to")
    return tuple(os.path.abspath(p) for p in paths)


def _remove_stale(paths, table):
    """The SSD files of this table that a killed process left behind (its PID no longer runs)."""
    for path in paths:
        try:
            entries = os.listdir(path)
        except OSError:
            continue
        for entry in entries:
            match = _OWN_DIR.fullmatch(entry)
            if match and match["table"] == table and not psutil.pid_exists(int(match["pid"])):
                shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
                log.info("removed %s, SSD files of table %r left by a process that no longer runs", entry, table)


class SsdTier:
    """One table's SSD tier on this rank: `rows` (its share of ssd_vocabulary_size) under `paths`."""

    def __init__(self, paths, rows, policy):
        self.paths = tuple(paths)
        self.rows = rows
        self.policy = policy
        self._index = None

    def attach(self, index: Any, rank: int) -> None:
        _remove_stale(self.paths, index.name)
        index.set_ssd(self.rows, list(self.paths), rank, self.policy)
        self._index = index

    def close(self) -> None:
        """Removes this rank's SSD files (a clean shutdown; checkpoints hold every row)."""
        if self._index is not None:
            self._index.close_ssd()

    def counters(self, index: Any) -> "TierCounters":
        return TierCounters(moves=index.tier_counters(), rows_on_ssd=index.rows_on_ssd(), rows=index.size(),
                            ssd_file_bytes=index.ssd_file_bytes())


@dataclass(frozen=True)
class TierCounters:
    """Where a shard's rows are and what moved: the native core's counters (memory_hits, ssd_hits,
    misses, swapped_in / _out, bytes_swapped_in / _out, swapped_in / _out_last_step) with the rows
    on each tier and the bytes of the SSD files."""
    moves: Any  # shardrec.native.core.TierCounters
    rows_on_ssd: int
    rows: int
    ssd_file_bytes: int

    @property
    def rows_in_memory(self) -> int:
        return self.rows - self.rows_on_ssd

    def as_dict(self) -> dict:
        return {"rows_in_memory": self.rows_in_memory, "rows_on_ssd": self.rows_on_ssd, **self.moves.as_dict(),
                "ssd_file_bytes": self.ssd_file_bytes}


def check_datasets(tables: dict, insert_functions: list) -> None:
    """At start_asc_pipeline: a table with an SSD tier takes one training and one evaluation
    dataset at most (the rows of their batches in flight are pinned by ticket, one sequence per
    channel)."""
    users = {}
    for insert in insert_functions:
        for spec in insert.specs:
            table = tables[spec.table_name]
            if table.ssd is None:
                continue
            seen = users.setdefault((table.table_name, insert.channel), insert)
            if seen is not insert:
                raise ValueError(f"table {table.table_name!r} has an SSD tier and is looked up by two {insert.channel.label} "
                                 "datasets (two get_asc_insert_func maps); a table with an SSD tier takes one training "
                                 "and one evaluation dataset")
