"""A shard's MANIFEST.json as types: the shard (ShardManifest), each table's entry (TableEntry), each
array file's entry (ArrayEntry), a table's admission state (AdmissionEntry) and the saves a delta
builds on (SaveRef). Validated once, when read (from_json): a missing key, or one of the wrong
type, is a CheckpointError naming the manifest and the key; nothing else reads a manifest by its
keys. Written through to_json(), key for key what version 1 has always written, so that files
written by any release of version 1 read the same (tests/test_checkpoint_format.py reads a kept
one)."""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .array_files import ArrayEntry, CheckpointError
from .sharding_plan import PlanError, TablePlan
from .stream_positions import StreamPositions

FORMAT = "shardrec-sparse-shard"
VERSION = 1
FULL, DELTA = "full", "delta"
SHARED, PER_RANK = "shared", "per_rank"
PENDING = ("pending_keys", "pending_counts", "pending_last_seen")
ADMISSION_ARRAYS = ("counts", "last_seen", *PENDING)
REMOVED = "removed"


class _Reader:
    """Reads keys of one JSON object, naming the manifest and the object's place when one is
    missing or of the wrong type."""

    def __init__(self, raw, where: str, source: str):
        if not isinstance(raw, dict):
            raise CheckpointError(f"{source}: {where} is not an object")
        self.raw, self.where, self.source = raw, where, source

    def get(self, key, types, default=..., optional=False):
        if key not in self.raw or (optional and self.raw[key] is None):
            if default is not ...:
                return default
            raise CheckpointError(f"{self.source}: {self.where} has no {key!r}")
        value = self.raw[key]
        if not isinstance(value, types) or isinstance(value, bool) and bool not in _as_tuple(types):
            expected = " or ".join(t.__name__ for t in _as_tuple(types))
            raise CheckpointError(f"{self.source}: {self.where}'s {key!r} is {value!r}; a manifest has {expected} there")
        return value

    def at(self, key) -> "_Reader":
        return _Reader(self.get(key, dict), f"{self.where}.{key}", self.source)


def _as_tuple(types):
    return types if isinstance(types, tuple) else (types,)


def _array_entry(r: _Reader) -> ArrayEntry:
    shape = r.get("shape", list)
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise CheckpointError(f"{r.source}: {r.where}'s shape {shape!r} is not a list of sizes")
    return ArrayEntry(r.get("file", str), r.get("bytes", int), r.get("crc32", int), r.get("dtype", str), tuple(shape))


@dataclass(frozen=True)
class AdmissionEntry:
    """A table with admission: its thresholds, the newest data timestamp its ranks had seen, and
    how many keys still count towards admission (the pending arrays' rows)."""
    access_threshold: int
    eviction_threshold: int
    newest: int
    pending_rows: int

    def to_json(self) -> dict:
        return {"access_threshold": self.access_threshold, "eviction_threshold": self.eviction_threshold,
                "newest": self.newest, "pending_rows": self.pending_rows}

    @classmethod
    def from_json(cls, r: "_Reader") -> "AdmissionEntry":
        return cls(r.get("access_threshold", int), r.get("eviction_threshold", int), r.get("newest", int, -1),
                   r.get("pending_rows", int))


@dataclass(frozen=True)
class TableEntry:
    """A table's part of a shard. files: array name ("keys", "values", "<optimizer>.<slot>", with
    admission "counts", "last_seen" and PENDING, in a delta REMOVED) -> its entry. removed_rows: a
    delta's keys removed since the previous save."""
    dim: int
    key_dtype: str
    rows: int
    optimizers: List[str]
    slots: List[str]
    files: Dict[str, ArrayEntry]
    admission: Optional[AdmissionEntry] = None
    removed_rows: Optional[int] = None
    # Where the table lived when saved (its rows are saved once whatever it was); None: row-wise,
    # as every save before placements.
    sharding: Optional[TablePlan] = None

    def rows_of(self, name: str) -> Optional[int]:
        """The rows the manifest says its array `name` has."""
        if name in PENDING:
            return self.admission.pending_rows if self.admission else None
        if name == REMOVED:
            return self.removed_rows
        return self.rows

    def to_json(self) -> dict:
        out = {"dim": self.dim, "key_dtype": self.key_dtype, "rows": self.rows, "optimizers": list(self.optimizers),
               "slots": list(self.slots), "files": {k: v.to_json() for k, v in self.files.items()}}
        if self.admission is not None:
            out["admission"] = self.admission.to_json()
        if self.removed_rows is not None:
            out["removed_rows"] = self.removed_rows
        if self.sharding is not None:
            out["sharding"] = self.sharding.to_json()
        return out

    @classmethod
    def from_json(cls, r: _Reader, name: str = "", world_size: int = 1) -> "TableEntry":
        files = r.at("files")
        admission = r.get("admission", dict, None, optional=True)
        sharding = r.get("sharding", dict, None, optional=True)
        try:
            plan = TablePlan.from_json(name, sharding, world_size, r.source) if sharding is not None else None
        except PlanError as e:
            raise CheckpointError(str(e)) from None
        return cls(r.get("dim", int), r.get("key_dtype", str), r.get("rows", int), r.get("optimizers", list),
                   r.get("slots", list), {k: _array_entry(files.at(k)) for k in files.raw},
                   AdmissionEntry.from_json(r.at("admission")) if admission is not None else None,
                   r.get("removed_rows", int, None, optional=True), plan)


@dataclass(frozen=True)
class SaveRef:
    """A save that a delta builds on: its dense prefix's base name (model.ckpt-40), step and id."""
    name: str
    step: int
    save_id: str

    def to_json(self) -> dict:
        return {"name": self.name, "step": self.step, "save_id": self.save_id}

    @classmethod
    def from_json(cls, r: _Reader) -> "SaveRef":
        return cls(r.get("name", str), r.get("step", int), r.get("save_id", str))


@dataclass(frozen=True)
class SaveKind:
    """What a shard's manifest says of its save: a full one, or a delta on `previous` (and so on
    back to `base`, the full save)."""
    kind: str
    save_id: Optional[str]  # None: a save of a job without incremental checkpoints
    base: Optional[SaveRef] = None
    previous: Optional[SaveRef] = None


@dataclass(frozen=True)
class ShardManifest:
    """One rank's shard of a save. step: the training step (None: saved without one). layout:
    SHARED (every rank saved under one path) or PER_RANK. kind, save_id, base, previous: see
    SaveKind; a manifest without "kind" (a job without incremental checkpoints) is a full save with
    no id."""
    step: Optional[int]
    rank: int
    world_size: int
    layout: str
    tables: Dict[str, TableEntry]
    kind: str = FULL
    save_id: Optional[str] = None
    base: Optional[SaveRef] = None
    previous: Optional[SaveRef] = None
    stream: Optional[StreamPositions] = None  # a job that trains from a stream (stream/)
    source: str = field(default="", compare=False)  # the file it was read from, for messages

    @property
    def shared(self) -> bool:
        return self.layout != PER_RANK

    def to_json(self) -> dict:
        out = {"format": FORMAT, "version": VERSION, "step": self.step, "rank": self.rank,
               "world_size": self.world_size, "layout": self.layout}
        if self.save_id is not None:
            out.update(kind=self.kind, save_id=self.save_id)
            if self.kind == DELTA:
                assert self.base is not None and self.previous is not None  # read_manifest and SaveKind check it
                out.update(base=self.base.to_json(), previous=self.previous.to_json())
        if self.stream is not None:
            out["stream"] = self.stream.to_json()
        out["tables"] = {name: entry.to_json() for name, entry in self.tables.items()}
        return out

    @classmethod
    def from_json(cls, raw, source: str) -> "ShardManifest":
        r = _Reader(raw, "the manifest", source)
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise CheckpointError(f"{source}: not a {FORMAT} manifest of version {VERSION}")
        kind = r.get("kind", str, FULL)
        if kind not in (FULL, DELTA):
            raise CheckpointError(f"{source}: the manifest's kind {kind!r} is neither {FULL!r} nor {DELTA!r}")
        links = {k: SaveRef.from_json(r.at(k)) for k in ("base", "previous") if kind == DELTA}
        tables = r.at("tables")
        layout = r.get("layout", str, SHARED)
        stream = StreamPositions.from_json(raw["stream"], source) if raw.get("stream") is not None else None
        return cls(r.get("step", int, None, optional=True), r.get("rank", int), r.get("world_size", int), layout,
                   {name: TableEntry.from_json(tables.at(name), name, r.get("world_size", int))
                    for name in tables.raw}, kind,
                   r.get("save_id", str, None, optional=True), stream=stream, source=source, **links)
