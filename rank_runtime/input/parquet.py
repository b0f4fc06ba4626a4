"""Parquet files read as training batches with Apache Arrow's reader: only the declared columns,
a row group at a time, cut into batches of columns (columns.py) with no per-row parsing.

Row groups are the unit of work. The files' row groups, in the order of the files (as given, or a
directory's *.parquet by name) and of their row groups, are dealt to `partitions`: row group g
to partition g % partitions, and partition i is read by rank i % world size, so every row is read
by exactly one rank. A partition is a sequence: its row groups, once an epoch, in their order or,
with a shuffle seed, in an order drawn from (seed, epoch, partition), each row group's rows
shuffled too (the shuffle buffer is one row group). A rank takes a row group from each of its
partitions in turn. Everything is a function of the files and the parameters, so every rank
knows every partition's sequence.

Exactly once: a partition's position is how many rows of its sequence training took (and the file
of the last one, to check that the files are the same). Every checkpoint holds each partition's
position (stream/cursor.py, as for the streams); a restore, into the same ranks or other ones,
starts every partition there. For a job that changes its rank count keep `partitions` fixed
(at least the most ranks it runs on): its default is the rank count of the first run.
"""
import collections
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tensorflow as tf

from ..formats.stream_positions import PartitionPosition
from ..process import config
from ..process.logs import get_logger
from ..stream.cursor import StreamCursor
from ..stream.partitioned import PartitionedStream, PartitionLag
from ..validation import check_bool, check_int
from .columns import (Column, ParquetInputError, batch_arrays, column_of, cut_arrays, declared, join_arrays, null_column,
                      ragged_outputs, take_arrays)

log = get_logger("shardrec.input")
OWNER = "ParquetDataset"
OPEN_FILES = 8  # ParquetFile handles kept open by a reader


@dataclass(frozen=True)
class RowGroup:
    file: int  # index into the dataset's paths
    group: int
    rows: int


def _paths(files: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]) -> List[str]:
    if isinstance(files, (str, os.PathLike)):
        path = os.fspath(files)
        if os.path.isdir(path):
            found = sorted(n for n in os.listdir(path) if n.endswith(".parquet") and not n.startswith("."))
            if not found:
                raise ParquetInputError(f"{OWNER}: directory {path!r} holds no *.parquet file")
            return [os.path.join(path, n) for n in found]
        files = [path]
    if isinstance(files, (bytes, Mapping)) or not isinstance(files, Sequence) or not files:
        raise TypeError(f"{OWNER}: parameter 'files' must be a directory, a file path or a non-empty list of file "
                        f"paths, got {files!r}")
    out = []
    for f in files:
        if not isinstance(f, (str, os.PathLike)):
            raise TypeError(f"{OWNER}: parameter 'files' holds {f!r}; every entry must be a file path")
        out.append(os.fspath(f))
    if len(set(out)) != len(out):
        raise ValueError(f"{OWNER}: parameter 'files' names a file twice: every row is read once")
    return out


def open_file(path: str, owner: str = OWNER) -> pq.ParquetFile:
    if not os.path.isfile(path):
        raise ParquetInputError(f"{owner}: {path!r} is not a file")
    if os.path.getsize(path) == 0:
        raise ParquetInputError(f"{owner}: {path!r} is empty (0 bytes), not a Parquet file: remove it or write it "
                                "again")
    try:
        return pq.ParquetFile(path, memory_map=True)
    except (pa.ArrowException, OSError) as e:
        raise ParquetInputError(f"{owner}: {path!r} cannot be read as Parquet ({' '.join(str(e).split())}): the "
                                "file is damaged or of another format") from None


def read_group(f: pq.ParquetFile, path: str, group: int, rows: int, columns: Sequence[Column],
               owner: str) -> pa.Table:
    """The declared columns of a row group, checked: readable, as many rows as the footer says,
    no missing value."""
    names = [c.name for c in columns]
    try:
        table = f.read_row_group(group, columns=names, use_threads=False)
    except (pa.ArrowException, OSError) as e:
        raise ParquetInputError(f"{owner}: {path!r} row group {group}, column {_failing(f, group, names)!r}: "
                                f"cannot be read ({' '.join(str(e).split())}); the file is damaged: write it "
                                "again") from None
    if table.num_rows != rows:
        raise ParquetInputError(f"{owner}: {path!r} row group {group} holds {table.num_rows} rows, its footer "
                                f"says {rows}: the file is damaged")
    bad = null_column(table, columns)
    if bad:
        raise ParquetInputError(f"{owner}: {path!r} row group {group}, column {bad!r}: missing values (null); "
                                "every declared column needs a value in every row (and in every list)")
    return table


def _failing(f: pq.ParquetFile, group: int, names: Sequence[str]) -> str:
    """The first column of a row group that does not read (for the message)."""
    for name in names:
        try:
            f.read_row_group(group, columns=[name], use_threads=False)
        except (pa.ArrowException, OSError):
            return name
    return "?"


def file_columns(f: pq.ParquetFile, path: str, wanted: Sequence[Tuple[str, str, str, int, int]],
                 owner: str) -> List[Column]:
    """The declared columns (columns.declared()) as a file holds them, each checked against its type."""
    schema = f.schema_arrow
    where = f"{owner}: {path!r}"
    missing = [name for name, *_ in wanted if schema.get_field_index(name) < 0]
    if missing:
        raise ParquetInputError(f"{where} has no column {', '.join(map(repr, missing))}; its columns: "
                                f"{', '.join(schema.names)}")
    return [dataclasses.replace(column_of(name, kind, schema.field(name).type, where), group=group, slot=slot,
                                width=width) for name, kind, group, slot, width in wanted]


def same_types(types: Dict[str, pa.DataType], f: pq.ParquetFile, path: str, first: str, owner: str) -> None:
    """Every declared column of `f` has the Arrow type it has in the file `first` (types)."""
    for name, t in types.items():
        have = f.schema_arrow.field(name).type
        if have != t:
            raise ParquetInputError(f"{owner}: {path!r}: column {name!r} is {have}, but in {first!r} it is {t}: every "
                                    "file must have the same schema for the declared columns")


class Piece:
    """Rows of a row group not yet in a batch: the row group's arrays (columns.batch_arrays, made
    once a row group) and a range of their rows, or in a shuffled read an order of them (gathered
    when the batch is made: the one copy of a shuffled batch)."""

    def __init__(self, arrays: Dict[str, np.ndarray], ragged: Sequence[str], rows: int,
                 order: Optional[np.ndarray] = None, start: int = 0):
        self._arrays, self._ragged, self._order, self._start = arrays, ragged, order, start
        self.rows = rows if order is None else len(order)

    @classmethod
    def of(cls, table: pa.Table, columns: Sequence[Column], order: Optional[np.ndarray] = None) -> "Piece":
        return cls(batch_arrays(table, columns), ragged_outputs(columns), table.num_rows, order)

    def cut(self, start: int, stop: Optional[int] = None) -> "Piece":
        stop = self.rows if stop is None else stop
        if self._order is None:
            return Piece(self._arrays, self._ragged, stop - start, None, self._start + start)
        return Piece(self._arrays, self._ragged, stop - start, self._order[start:stop])

    def arrays(self) -> Dict[str, np.ndarray]:
        if self._order is not None:
            return take_arrays(self._arrays, self._ragged, self._order)
        return cut_arrays(self._arrays, self._ragged, self._start, self._start + self.rows)


class ParquetSource(PartitionedStream):
    """The reader behind ParquetDataset(); `training_stream()` returns it while it is the
    dataset training reads."""

    def __init__(self, files, batch_size: int, columns: Mapping[str, Any], partitions: Optional[int] = None,
                 num_epochs: int = 1, shuffle_seed: Optional[int] = None, drop_remainder: bool = True,
                 training: bool = True, shard: Optional[Tuple[int, int]] = None):
        self.paths = _paths(files)
        self.batch_size = check_int(OWNER, "batch_size", batch_size, 1, 1 << 24)
        self.num_epochs = check_int(OWNER, "num_epochs", num_epochs, 1, 1 << 20)
        if shuffle_seed is not None:
            check_int(OWNER, "shuffle_seed", shuffle_seed, 0, 2**63 - 1)
        self.shuffle_seed = shuffle_seed
        self.drop_remainder = check_bool(OWNER, "drop_remainder", drop_remainder)
        self.training = check_bool(OWNER, "training", training)
        wanted = declared(columns, OWNER)
        self._types: Dict[str, pa.DataType] = {}  # the first file's Arrow type of each declared column
        if shard is not None:
            if training:
                raise ValueError(f"{OWNER}: parameter 'shard' is for a dataset read outside shardrec's training "
                                 "(training=False): a training dataset reads the shard of its rank")
            if not (isinstance(shard, tuple) and len(shard) == 2 and all(isinstance(x, int) for x in shard) and
                    0 <= shard[0] < shard[1]):
                raise ValueError(f"{OWNER}: parameter 'shard' must be (rank, size) with 0 <= rank < size, got {shard!r}")
        self.shard = shard
        if partitions is None:
            partitions = shard[1] if shard is not None else config.get_config().size
        super().__init__(OWNER, f"{len(self.paths)} Parquet file(s) under "
                                f"{os.path.commonpath([os.path.abspath(p) for p in self.paths])!r}", partitions, None)
        self.columns, self.groups = self._check_files(wanted)
        self._files: "collections.OrderedDict[int, pq.ParquetFile]" = collections.OrderedDict()
        self._sequences: Dict[str, Tuple[List[RowGroup], np.ndarray]] = {}

    # ----- what the files hold, checked on every rank before anything is read
    def _check_files(self, wanted: List[Tuple[str, str, str, int, int]]) -> Tuple[List[Column], List[RowGroup]]:
        columns: List[Column] = []
        groups: List[RowGroup] = []
        first = ""
        for i, path in enumerate(self.paths):
            f = open_file(path)
            these = file_columns(f, path, wanted, OWNER)
            if not columns:
                columns, first = these, path
                self._types = {name: f.schema_arrow.field(name).type for name, *_ in wanted}
            else:
                same_types(self._types, f, path, first, OWNER)
            rows = 0
            for g in range(f.metadata.num_row_groups):
                n = f.metadata.row_group(g).num_rows
                if n:
                    groups.append(RowGroup(i, g, n))
                    rows += n
            if not rows:
                raise ParquetInputError(f"{OWNER}: {path!r} holds no rows: remove it from the input")
        if len(groups) < self.partitions:
            raise ParquetInputError(f"{OWNER}: the files hold {len(groups)} row group(s) for {self.partitions} "
                                    "partitions; every partition needs one: give fewer partitions or write smaller row "
                                    "groups (shardrec-convert --row-group-rows)")
        return columns, groups

    # ----- a partition's sequence: its row groups once an epoch
    def _sequence(self, partition: str) -> Tuple[List[RowGroup], np.ndarray]:
        """The partition's row groups (of one epoch, in file order) and the ends of their rows."""
        if partition not in self._sequences:
            p = int(partition)
            mine = [g for k, g in enumerate(self.groups) if k % self.partitions == p]
            self._sequences[partition] = (mine, np.cumsum([g.rows for g in mine]))
        return self._sequences[partition]

    def _order(self, partition: str, epoch: int) -> np.ndarray:
        mine, _ = self._sequence(partition)
        if self.shuffle_seed is None:
            return np.arange(len(mine))
        return np.random.default_rng([self.shuffle_seed, epoch, int(partition)]).permutation(len(mine))

    def _locate(self, partition: str, row: int) -> Tuple[int, int, int]:
        """(epoch, index in that epoch's order, row within the row group) of the partition's row."""
        mine, ends = self._sequence(partition)
        epoch, at = divmod(row, int(ends[-1]))
        ends = np.cumsum([mine[k].rows for k in self._order(partition, epoch)])
        index = int(np.searchsorted(ends, at, side="right"))
        return epoch, index, at - (int(ends[index - 1]) if index else 0)

    def _total(self, partition: str) -> int:
        return int(self._sequence(partition)[1][-1]) * self.num_epochs

    def _group_at(self, partition: str, epoch: int, index: int) -> RowGroup:
        mine, _ = self._sequence(partition)
        return mine[int(self._order(partition, epoch)[index])]

    # ----- reading
    def _file(self, i: int) -> pq.ParquetFile:
        f = self._files.pop(i, None) or open_file(self.paths[i])
        self._files[i] = f
        while len(self._files) > OPEN_FILES:
            self._files.popitem(last=False)
        return f

    def _read_group(self, g: RowGroup) -> pa.Table:
        return read_group(self._file(g.file), self.paths[g.file], g.group, g.rows, self.columns, OWNER)

    def _order_of(self, g: RowGroup, epoch: int, partition: str) -> Optional[np.ndarray]:
        """A shuffled read's order of the row group's rows (None: file order)."""
        if self.shuffle_seed is None:
            return None
        return np.random.default_rng([self.shuffle_seed, epoch, int(partition), g.file, g.group]).permutation(g.rows)

    def _start(self, partition: str, at: PartitionPosition) -> int:
        """The partition's row where reading starts, checked against the file the position names."""
        row = at.offset
        if row > self._total(partition):
            raise ParquetInputError(f"{OWNER}: the checkpoint's position of partition {partition} is row {row}, past "
                                    f"the {self._total(partition)} rows it holds now: the files changed since the save")
        if row and at.file is not None:
            epoch, index, _ = self._locate(partition, row - 1)
            here = os.path.basename(self.paths[self._group_at(partition, epoch, index).file])
            if here != at.file:
                raise ParquetInputError(
                    f"{OWNER}: the checkpoint's position of partition {partition} is row {row} of its sequence, in "
                    f"{at.file!r}, but the files given put that row in {here!r}: the files, their order or their "
                    "row groups changed since the save; train from the same files")
        return row

    def _slices(self, cursor: StreamCursor, resume: Optional[str]) -> Iterator["Piece"]:
        """Row group slices in reading order, each logged to the cursor as it is handed out."""
        owned = list(self.owned)
        rows = {p: self._start(p, cursor.initial[p]) for p in owned}
        turn = 0
        if resume in owned:
            _, _, within = self._locate(resume, rows[resume]) if rows[resume] < self._total(resume) else (0, 0, 0)
            turn = (owned.index(resume) + (within == 0 and rows[resume] > 0)) % len(owned)
        while True:
            live = [p for p in owned if rows[p] < self._total(p)]
            if not live:
                return
            while owned[turn % len(owned)] not in live:
                turn += 1
            partition = owned[turn % len(owned)]
            turn = (turn + 1) % len(owned)
            epoch, index, within = self._locate(partition, rows[partition])
            g = self._group_at(partition, epoch, index)
            piece = Piece.of(self._read_group(g), self.columns, self._order_of(g, epoch, partition)).cut(within)
            cursor.handed(partition, os.path.basename(self.paths[g.file]), rows[partition], piece.rows)
            rows[partition] += piece.rows
            yield piece

    def _read(self, cursor: StreamCursor, resume: Optional[str]) -> Iterator[Dict[str, np.ndarray]]:
        return batches(self._slices(cursor, resume), self.batch_size, self.drop_remainder, self.columns)

    def _records(self) -> tf.data.Dataset:
        return batch_dataset(self._generator, self.columns, self.batch_size, self.drop_remainder)

    def _prepare(self) -> None:
        pass

    def dataset(self) -> tf.data.Dataset:
        if self.training:
            return super().dataset()
        rank, size = self.shard or (config.get_config().rank, config.get_config().size)
        self.owned = [n for i, n in enumerate(self.names) if i % size == rank]
        self.cursor = StreamCursor({p: PartitionPosition(None, 0) for p in self.owned})
        return self._records()

    def lag(self) -> Dict[str, PartitionLag]:
        return {p: PartitionLag(at.offset, self._total(p) - at.offset, 0.0) for p, at in self.cursor.latest().items()}


def batches(pieces: Iterable[Piece], size: int, drop_remainder: bool,
            columns: Sequence[Column]) -> Iterator[Dict[str, np.ndarray]]:
    """Batches of `size` rows of the pieces, in order (the last one shorter unless drop_remainder)."""
    ragged = ragged_outputs(columns)
    pending: "collections.deque[Piece]" = collections.deque()
    held = 0
    for piece in pieces:
        pending.append(piece)
        held += piece.rows
        while held >= size:
            parts, need = [], size
            while need:
                part = pending.popleft()
                if part.rows > need:
                    pending.appendleft(part.cut(need))
                    part = part.cut(0, need)
                parts.append(part.arrays())
                need -= part.rows
            held -= size
            yield parts[0] if len(parts) == 1 else join_arrays(parts, ragged)
    if held and not drop_remainder:
        parts = [p.arrays() for p in pending]
        yield parts[0] if len(parts) == 1 else join_arrays(parts, ragged)


def batch_dataset(generator: Callable[[], Iterator[Dict[str, np.ndarray]]], columns: Sequence[Column],
                  batch_size: int, drop_remainder: bool) -> tf.data.Dataset:
    """The generator's batches as a dataset of a tensor an output (a RaggedTensor a list column)."""
    b = batch_size if drop_remainder else None
    signature = {}
    for c in columns:
        dtype = tf.int64 if c.kind in ("id", "ids") else tf.float32
        if c.group:
            signature[c.group] = tf.TensorSpec([b, c.width], dtype)
        elif c.ragged:
            signature[c.name + "/values"] = tf.TensorSpec([None], dtype)
            signature[c.name + "/row_splits"] = tf.TensorSpec([None if b is None else b + 1], tf.int64)
        else:
            signature[c.name] = tf.TensorSpec([b] + ([c.fixed] if c.fixed else []), dtype)
    flat = tf.data.Dataset.from_generator(generator, output_signature=signature)
    ragged = [c.name for c in columns if c.ragged]
    if not ragged:
        return flat

    def assemble(arrays):
        out = {c.group or c.name: arrays[c.group or c.name] for c in columns if not c.ragged}
        for name in ragged:
            out[name] = tf.RaggedTensor.from_row_splits(arrays[name + "/values"], arrays[name + "/row_splits"],
                                                        validate=False)
        return out
    return flat.map(tf.autograph.experimental.do_not_convert(assemble))


def ParquetDataset(files, batch_size: int, columns: Mapping[str, Any], *, partitions: Optional[int] = None,
                   num_epochs: int = 1, shuffle_seed: Optional[int] = None, drop_remainder: bool = True,
                   training: bool = True, shard: Optional[Tuple[int, int]] = None) -> tf.data.Dataset:
    """Batches of `batch_size` rows of Parquet `files` (a directory, a path or a list of paths) as
    a dict of tensors, one per declared column ({name: "id" | "ids" | "float" | "floats"}, or
    {name: ("id" | "float", [scalar columns])} for those columns stacked as one [batch, k] tensor;
    see input/columns.py), for `dataset.map(get_asc_insert_func(...))`. Call after init(). A training
    dataset's positions are in every checkpoint (exactly once through restores and resizes);
    training=False for an evaluation dataset, which every rank reads its share of from the start;
    with shard=(rank, size) as well, a process outside shardrec (a peer, a converter's check) reads
    that share without init()."""
    return ParquetSource(files, batch_size, columns, partitions, num_epochs, shuffle_seed, drop_remainder,
                         training, shard).dataset()
