"""TFRecord files of tf.train.Example to Parquet, a row group at a time (shardrec-convert).

The schema comes from the Examples (the first `infer_records` records of the first file: a
feature of one value a row is a scalar column, of the same number of values in every record seen
a fixed-size list, else a list) or is declared as ParquetDataset's columns ({name: kind}, with
"ids:K" / "floats:K" for a fixed-size list of K). Records are read and parsed by TensorFlow
(tf.data and parse_example, a row group's records a call), so memory holds one row group. A
record that does not match the schema stops the conversion naming the file, the record's number
and the feature; the file being written is left under its dot-name, never renamed into place.
"""
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ...native import framing
from .columns import KINDS

INFER_RECORDS = 1000


class ConvertError(ValueError):
    """A record or a file that cannot be converted: the message names it."""


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # columns.KINDS
    fixed: int  # values a row of a fixed-size list; 0: a list of any length; 1 with a scalar kind
    strings: bool = False  # "id"/"ids" kept as strings (bytes_list), hashed when read

    def arrow_type(self) -> pa.DataType:
        value = pa.string() if self.strings else (pa.int64() if self.kind in ("id", "ids") else pa.float32())
        if self.kind in ("id", "float"):
            return value
        item = pa.field("item", value, nullable=False)
        return pa.list_(item, self.fixed) if self.fixed else pa.list_(item)

    def arrow_field(self) -> pa.Field:
        """Required (not nullable), as ParquetDataset requires a value in every row: Parquet then
        stores no definition levels, which a reader otherwise decodes (1.1 ns an id of 5)."""
        return pa.field(self.name, self.arrow_type(), nullable=False)


def _tf():
    import tensorflow as tf

    return tf


def parse_columns(text: Mapping[str, str]) -> List[Field]:
    """--column NAME=KIND[:K] declarations as fields (ints, floats; strings are inferred only)."""
    out = []
    for name, kind in text.items():
        base, _, k = kind.partition(":")
        if base not in KINDS or (k and (base in ("id", "float") or not k.isdigit() or int(k) < 1)):
            raise ConvertError(f"column {name!r} is declared {kind!r}; allowed: id, float, ids, floats, ids:K, floats:K "
                               "(K >= 1: a fixed-size list)")
        out.append(Field(name, base, int(k) if k else (1 if base in ("id", "float") else 0)))
    return out


def check_framing(path: str) -> int:
    """The records of a TFRecord file whose framing and CRCs hold (native, storage/tfrecord_framing.h)."""
    counted = framing.count_tfrecords(path, check_crc=True)
    if counted.bad_offset >= 0:
        raise ConvertError(f"{path}: record {counted.records} at byte {counted.bad_offset}: the file is damaged or not "
                           "TFRecord (its length or CRC does not hold); nothing of it was converted")
    return counted.records


def infer_fields(path: str, records: int = INFER_RECORDS) -> List[Field]:
    """The fields of the first `records` Examples of `path`."""
    tf = _tf()
    check_framing(path)
    kinds: Dict[str, Tuple[str, set]] = {}
    for i, raw in enumerate(tf.compat.v1.io.tf_record_iterator(path)):
        if i == records:
            break
        example = tf.train.Example.FromString(raw)
        for name, feature in example.features.feature.items():
            which = feature.WhichOneof("kind")
            values = getattr(feature, which).value if which else []
            seen = kinds.setdefault(name, (which, set()))
            if which and seen[0] != which:
                raise ConvertError(f"{path}: record {i}: feature {name!r} is a {which}, earlier records have a "
                                   f"{seen[0]}: one feature has one type")
            seen[1].add(len(values))
    if not kinds:
        raise ConvertError(f"{path}: no record with features among its first {records}: nothing to infer a schema from")
    out = []
    for name, (which, lengths) in sorted(kinds.items()):
        scalar = lengths == {1}
        kind = ("id" if scalar else "ids") if which in ("int64_list", "bytes_list") else ("float" if scalar else "floats")
        fixed = 1 if scalar else (lengths.pop() if len(lengths) == 1 else 0)
        out.append(Field(name, kind, fixed, strings=which == "bytes_list"))
    return out


def _spec(fields: List[Field]):
    tf = _tf()
    out = {}
    for f in fields:
        dtype = tf.string if f.strings else (tf.int64 if f.kind in ("id", "ids") else tf.float32)
        if f.kind in ("id", "float"):
            out[f.name] = tf.io.FixedLenFeature([], dtype)
        elif f.fixed:
            out[f.name] = tf.io.FixedLenFeature([f.fixed], dtype)
        else:
            out[f.name] = tf.io.RaggedFeature(dtype)
    return out


def _arrow(field: Field, value) -> pa.Array:
    if field.kind in ("ids", "floats") and not field.fixed:
        flat = value.flat_values
        if field.strings:
            flat = np.char.decode(flat.astype(bytes), "utf-8") if flat.size else flat.astype(str)
        return pa.ListArray.from_arrays(pa.array(value.row_splits.astype(np.int32)),
                                        pa.array(flat, field.arrow_type().value_type))
    array = value
    if field.strings:
        array = np.char.decode(array.astype(bytes), "utf-8") if array.size else array.astype(str)
    if field.kind in ("id", "float"):
        return pa.array(array, field.arrow_type())
    return pa.FixedSizeListArray.from_arrays(pa.array(array.reshape(-1), field.arrow_type().value_type), field.fixed)


def _first_bad(path: str, first: int, records: List[bytes], fields: List[Field]) -> str:
    """The first record of a batch that parse_example refused, and why."""
    tf = _tf()
    for i, raw in enumerate(records):
        example = tf.train.Example.FromString(raw).features.feature
        for f in fields:
            if f.name not in example:
                return f"{path}: record {first + i}: feature {f.name!r} is missing"
            which = example[f.name].WhichOneof("kind")
            want = "bytes_list" if f.strings else ("int64_list" if f.kind in ("id", "ids") else "float_list")
            values = getattr(example[f.name], which).value if which else []
            if which != want:
                return f"{path}: record {first + i}: feature {f.name!r} is a {which}, the schema's is a {want}"
            if f.fixed and len(values) != f.fixed:
                return (f"{path}: record {first + i}: feature {f.name!r} has {len(values)} value(s), the schema's "
                        f"{f.kind!r} column has {f.fixed}")
    return f"{path}: records {first} to {first + len(records) - 1}: parse_example refused the batch"


def _row_groups(path: str, fields: List[Field], rows: int) -> Iterator[pa.Table]:
    """The file's records a row group at a time, parsed by TensorFlow in a graph of its own (so
    whether the caller runs eagerly does not matter)."""
    tf = _tf()
    schema = pa.schema([f.arrow_field() for f in fields])
    first = 0
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        records = tf.compat.v1.data.make_one_shot_iterator(tf.data.TFRecordDataset(path).batch(rows)).get_next()
        given = tf.compat.v1.placeholder(tf.string, [None])
        parse = tf.io.parse_example(given, _spec(fields))
        while True:
            try:
                raw = sess.run(records)
            except tf.errors.OutOfRangeError:
                return
            try:
                parsed = sess.run(parse, {given: raw})
            except (tf.errors.InvalidArgumentError, ValueError):
                raise ConvertError(_first_bad(path, first, list(raw), fields)) from None
            yield pa.Table.from_arrays([_arrow(f, parsed[f.name]) for f in fields], schema=schema)
            first += len(raw)


def convert_file(source: str, target: str, fields: List[Field], row_group_rows: int,
                 progress: Optional[Callable[[int], None]] = None, compression: str = "snappy",
                 use_dictionary: bool = True) -> int:
    """Writes `source` as the Parquet file `target` (under a dot-name, renamed into place when
    complete); returns its rows. compression and use_dictionary as pyarrow's ParquetWriter takes them."""
    folder, name = os.path.split(target)
    os.makedirs(folder or ".", exist_ok=True)
    partial = os.path.join(folder, "." + name + ".partial")
    schema = pa.schema([f.arrow_field() for f in fields])
    check_framing(source)
    rows = 0
    with pq.ParquetWriter(partial, schema, compression=compression, use_dictionary=use_dictionary) as writer:
        for table in _row_groups(source, fields, row_group_rows):
            writer.write_table(table, row_group_size=row_group_rows)
            rows += table.num_rows
            if progress:
                progress(table.num_rows)
    if not rows:
        os.unlink(partial)
        raise ConvertError(f"{source}: no records: an empty Parquet file would be refused by ParquetDataset")
    os.replace(partial, target)
    return rows


def sources(inputs: List[str]) -> List[Tuple[str, str]]:
    """(source file, its path relative to the output) of files and directories (a directory
    stream's partition folders kept), dot-names skipped."""
    out = []
    for given in inputs:
        if os.path.isdir(given):
            for root, dirs, files in os.walk(given):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for f in sorted(files):
                    if not f.startswith("."):
                        path = os.path.join(root, f)
                        out.append((path, os.path.relpath(path, given)))
        elif os.path.isfile(given):
            out.append((given, os.path.basename(given)))
        else:
            raise ConvertError(f"{given}: no such file or directory")
    if not out:
        raise ConvertError(f"no TFRecord file under {', '.join(inputs)}")
    return out


class Progress:
    """One line on stderr, rewritten at most twice a second: files done, rows and rows/s."""

    def __init__(self, files: int, stream=None):
        self.files, self.done, self.rows, self.stream = files, 0, 0, stream or sys.stderr
        self.start = self.said = time.monotonic()

    def add(self, rows: int) -> None:
        self.rows += rows
        now = time.monotonic()
        if now - self.said >= 0.5:
            self.said = now
            self._say("\r")

    def file_done(self) -> None:
        self.done += 1
        self._say("\r")

    def end(self) -> None:
        self._say("\r")
        self.stream.write("\n")

    def _say(self, lead: str) -> None:
        rate = self.rows / max(time.monotonic() - self.start, 1e-9)
        bar = "#" * int(20 * self.done / self.files)
        self.stream.write(f"{lead}[{bar:<20}] {self.done}/{self.files} files, {self.rows} rows, {rate:,.0f} rows/s")
        self.stream.flush()
