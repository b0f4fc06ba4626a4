"""Reads shardrec checkpoints without TensorFlow: which ones exist, which are complete, whether
their files still match their manifests, and every rank's rows of a table in one place.

The format (layout, manifest, arrays) is rank_runtime/formats/sparse_checkpoint.py's, which imports no
TensorFlow; tests/test_ckpt_cli.py checks this reader against checkpoints that the Saver wrote.
"""
import glob
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from shardrec.rank_runtime.formats import checkpoint_chain
from shardrec.rank_runtime.formats import sparse_checkpoint as fmt
from shardrec.rank_runtime.formats.manifest import DELTA, SHARED, SaveRef, ShardManifest


@dataclass
class Shard:
    rank: int
    world_size: int
    path: str
    manifest: Optional[ShardManifest] = None
    problems: list = field(default_factory=list)


@dataclass
class Checkpoint:
    name: str        # the dense checkpoint's file prefix, e.g. model.ckpt-100
    sparse_dir: str
    shards: dict     # rank -> Shard
    problems: list = field(default_factory=list)

    @property
    def world_size(self) -> Optional[int]:
        sizes = {s.world_size for s in self.shards.values()}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def step(self) -> Optional[int]:
        steps = {s.manifest.step for s in self.shards.values() if s.manifest}
        return steps.pop() if len(steps) == 1 else None

    @property
    def kind(self) -> Optional[str]:
        """FULL or DELTA (an incremental job's save of what changed since the one before)."""
        kinds = {s.manifest.kind for s in self.shards.values() if s.manifest}
        return kinds.pop() if len(kinds) == 1 else None

    @property
    def previous(self) -> Optional[SaveRef]:
        """The save a delta builds on, else None."""
        for shard in self.shards.values():
            if shard.manifest and shard.manifest.kind == DELTA:
                return shard.manifest.previous
        return None

    @property
    def dense_prefix(self) -> str:
        return os.path.join(os.path.dirname(self.sparse_dir), self.name)

    @property
    def ok(self) -> bool:
        return not self.problems and all(not s.problems for s in self.shards.values())


def _dense_problems(prefix):
    """The files TensorFlow's Saver writes for a checkpoint: index, data shards, meta graph."""
    problems = []
    if not os.path.exists(f"{prefix}.index"):
        problems.append(f"{prefix}.index: missing (the dense part of the checkpoint)")
    if not glob.glob(glob.escape(prefix) + ".data-*-of-*"):
        problems.append(f"{prefix}.data-*: missing (the dense part of the checkpoint)")
    if not os.path.exists(f"{prefix}.meta"):
        problems.append(f"{prefix}.meta: missing (the meta graph; saved with write_meta_graph=False?)")
    return problems


def read_checkpoint(sparse_dir: str, verify: bool = True) -> "Checkpoint":
    """The checkpoint whose table shards lie in `sparse_dir` (<dir>/sparse-<name>)."""
    name = fmt.SPARSE_RE.fullmatch(os.path.basename(os.path.normpath(sparse_dir))).group(1)
    ckpt = Checkpoint(name, sparse_dir, {})
    by_size: Dict[int, List[str]] = {}
    for entry in sorted(os.listdir(sparse_dir)):
        m = fmt.SHARD_RE.fullmatch(entry)
        if m:
            shard = Shard(int(m.group(1)), int(m.group(2)), os.path.join(sparse_dir, entry))
            shard.manifest, shard.problems = fmt.verify_shard(shard.path, checksums=verify)
            by_size.setdefault(shard.world_size, []).append(entry)
            ckpt.shards.setdefault(shard.rank, shard)
        elif entry.startswith(".tmp-"):
            ckpt.problems.append(f"{os.path.join(sparse_dir, entry)}: a shard that was never committed")
    size = ckpt.world_size if len(by_size) == 1 else None
    if size is None:
        ckpt.problems.append("shards of different world sizes: " + "; ".join(
            f"{n} rank(s): {', '.join(entries)}" for n, entries in sorted(by_size.items()))
            + " (a save by another number of ranks did not replace them)" if by_size else "no shard")
    else:
        layouts = {s.manifest.layout for s in ckpt.shards.values() if s.manifest}
        expected = range(size) if layouts == {SHARED} else sorted(ckpt.shards)
        missing = [r for r in expected if r not in ckpt.shards]
        if missing:
            ckpt.problems.append(f"the shards of rank(s) {missing} of {size} are missing")
    ckpt.problems.extend(_dense_problems(ckpt.dense_prefix))
    if ckpt.kind == DELTA and not ckpt.problems:
        try:
            checkpoint_chain.resolve(ckpt.dense_prefix)
        except fmt.CheckpointError as e:
            ckpt.problems.append(f"its chain is broken: {e}")
    return ckpt


def find_checkpoints(path: str, verify: bool = True) -> List["Checkpoint"]:
    """Checkpoints at `path`: a model directory (all of them, oldest first), a sparse-<name>
    directory, or a dense checkpoint prefix such as <dir>/model.ckpt-100."""
    path = os.path.abspath(path)
    if os.path.isdir(path) and fmt.SPARSE_RE.fullmatch(os.path.basename(path)):
        return [read_checkpoint(path, verify)]
    head, tail = os.path.split(path)
    if os.path.isdir(os.path.join(head, f"sparse-{tail}")):
        return [read_checkpoint(os.path.join(head, f"sparse-{tail}"), verify)]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: neither a directory nor a checkpoint with a sparse-{tail} directory")
    found = [read_checkpoint(os.path.join(path, e), verify) for e in os.listdir(path)
             if fmt.SPARSE_RE.fullmatch(e) and os.path.isdir(os.path.join(path, e))]
    found = sorted(found, key=lambda c: (c.step is None, c.step or 0, c.name))

    by_name = {c.name: c for c in found}
    for ckpt in found:  # oldest first: a delta's previous save already carries its own chain's state
        previous = ckpt.previous
        link = by_name.get(previous.name) if previous is not None else None
        if link is not None and not link.ok:
            ckpt.problems.append(f"its chain is broken: {link.name}, the save it builds on, is damaged or incomplete")
    return found


def unfinished_saves(path: str) -> List[str]:
    """The staging directories (.sparse-<name>.saving) of saves that did not finish in the model
    directory `path`: not checkpoints, and no checkpoint of the same name was changed by them."""
    if not os.path.isdir(path):
        return []
    return sorted(os.path.join(path, e) for e in os.listdir(path) if fmt.STAGING_RE.fullmatch(e))


def table_rows(ckpt: "Checkpoint", table: str) -> Dict[str, np.ndarray]:
    """{"keys", "values", <optimizer>.<slot>...}: every rank's rows of `table`, concatenated in
    rank order (a delta's: its chain's rows at its step), each array read and verified against its
    manifest. Raises CheckpointError."""
    if not ckpt.ok:
        raise fmt.CheckpointError(f"{ckpt.sparse_dir}: damaged or incomplete: " +
                                  "; ".join(ckpt.problems + [p for s in ckpt.shards.values() for p in s.problems]))
    if ckpt.kind == DELTA:
        return checkpoint_chain.read_chain_table(checkpoint_chain.resolve(ckpt.dense_prefix), table)
    shards = {rank: shard.path for rank, shard in ckpt.shards.items()}
    link = checkpoint_chain.Link(ckpt.dense_prefix, shards, {r: s.manifest for r, s in ckpt.shards.items()},
                                 ckpt.world_size)
    return checkpoint_chain.read_chain_table([link], table)
