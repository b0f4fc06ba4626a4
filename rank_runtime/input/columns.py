"""Arrow columns as the arrays a batch is made of, declared by kind, checked against each file's
schema, and cut into batches with no Python object per row.

A column's kind says what the model takes from it:

    "id"      one id a row: int64 [B]. Arrow int8..int64 and uint8..uint32 (widened to int64: a
              copy), or string/binary, hashed (string_ids()).
    "ids"     several ids a row: a list column as a RaggedTensor [B, None] of int64, a fixed-size
              list of k as int64 [B, k]; strings in either are hashed.
    "float"   one number a row: float32 [B] (float64 and integers are converted: a copy).
    "floats"  several a row (a multi-hot feature's weights, a dense vector): ragged float32, or
              [B, k] for a fixed-size list.

A group, ("id" or "float", [k scalar columns]), stacks its columns as one [B, k] output (Criteo's
26 categorical columns as the one id tensor of a FeatureSpec): a scalar column a field is the
layout Parquet decodes fastest (no repetition levels), and the stacking is the group's one copy.

Copies, from the file's decoded buffers to the key pipeline's native call, one at most for a batch
that lies in one row group and is read in file order: the reader makes a row group's arrays once
(batch_arrays) and cuts each batch from them as views. A column of the declared dtype is a view of
Arrow's buffer, which tf.data's generator hands to TensorFlow without a copy when it starts on a
64-byte boundary (Arrow allocates so; a batch cut at a row whose offset is not a multiple of 64
bytes is copied there, once). Anything this module makes (a widened or converted column, hashed
strings, a group stacked, a ragged column's row splits) is written into a 64-byte aligned array,
which TensorFlow then takes as it is. A batch that straddles two row groups is joined (one more
copy; aligned); a shuffled read gathers each batch's rows (one more copy, aligned), and a shuffled
batch that straddles two row groups is gathered and then joined.
"""
import ctypes
import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np
import pyarrow as pa

KINDS = ("id", "ids", "float", "floats")
# Arrow's fixed-width types as numpy's, for views of their buffers (pyarrow's own to_numpy tries an
# import on every call: 0.25 ms, a third of a 4096-row batch's feed).
_NUMPY = {**{name: np.dtype(name) for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")},
          "float": np.dtype(np.float32), "double": np.dtype(np.float64)}
_ID_TYPES = "int8..int64, uint8..uint32, string or binary"
_FLOAT_TYPES = "float32, float64 or an integer type"


class ParquetInputError(ValueError):
    """Parquet input that cannot be read as declared: the message names the file, the row group
    (where one is at fault) and the column."""


@dataclass(frozen=True)
class Column:
    name: str
    kind: str
    fixed: int  # "ids"/"floats": k of a fixed-size list, 0 for a ragged list
    group: str = ""  # a member of a group of scalar columns stacked as one output [B, width]
    slot: int = 0  # its place in the group
    width: int = 0  # the group's members

    @property
    def ragged(self) -> bool:
        return self.kind in ("ids", "floats") and not self.fixed

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.int64) if self.kind in ("id", "ids") else np.dtype(np.float32)


def _scalar_ok(kind: str, t: pa.DataType) -> bool:
    if kind in ("id", "ids"):
        return (pa.types.is_integer(t) and t != pa.uint64()) or pa.types.is_string(t) or pa.types.is_binary(t) or \
            pa.types.is_large_string(t) or pa.types.is_large_binary(t)
    return pa.types.is_floating(t) and t != pa.float16() or pa.types.is_integer(t)


def column_of(name: str, kind: str, t: pa.DataType, where: str) -> Column:
    """The column `name` declared `kind`, checked against its Arrow type in a file (`where`)."""
    allowed = _ID_TYPES if kind in ("id", "ids") else _FLOAT_TYPES
    if kind in ("id", "float"):
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            raise ParquetInputError(f"{where}: column {name!r} is a list ({t}), but it is declared {kind!r}, one "
                                    f"value a row ({allowed}); declare it {kind + 's'!r} for a list")
        if not _scalar_ok(kind, t):
            raise ParquetInputError(f"{where}: column {name!r} is {t}; declared {kind!r}, it must be {allowed}")
        return Column(name, kind, 0)
    if pa.types.is_fixed_size_list(t):
        fixed = t.list_size
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        fixed = 0
    else:
        raise ParquetInputError(f"{where}: column {name!r} is {t}, not a list; declared {kind!r}, it must be a list "
                                f"(or fixed-size list) of {allowed}; declare it {kind[:-1]!r} for one value a row")
    if not _scalar_ok(kind, t.value_type):
        raise ParquetInputError(f"{where}: column {name!r} is {t}; declared {kind!r}, its values must be {allowed}")
    return Column(name, kind, fixed)


@functools.lru_cache(maxsize=None)
def _native():
    from ..embedding import native_ops

    native_ops.load()
    lib = ctypes.CDLL(native_ops.library_path())
    out = {}
    for bits, name in ((32, "shardrec_hash_strings32"), (64, "shardrec_hash_strings64")):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        fn.restype = None
        out[bits] = fn
    stack = lib.shardrec_stack_columns
    stack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    stack.restype = ctypes.c_int
    out["stack"] = stack
    return out


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised array whose data starts on a 64-byte boundary: TensorFlow adopts such a
    buffer without copying it (numpy's own are 16-byte aligned)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    raw = np.empty(count * dtype.itemsize + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + count * dtype.itemsize].view(dtype).reshape(shape)


def _converted(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    out = aligned_empty(values.shape, dtype)
    out[...] = values
    return out


def string_ids(array: pa.Array) -> np.ndarray:
    """int64 ids of a string or binary array: TensorFlow's Fingerprint64 of each value modulo
    2^63 - 1, equal to tf.strings.to_hash_bucket_fast(values, 2**63 - 1) (the op a serving graph
    that receives strings uses); computed natively over Arrow's buffers."""
    large = pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type)
    offset_type = np.int64 if large else np.int32
    _, offsets_buf, data_buf = array.buffers()
    n = len(array)
    offsets = np.frombuffer(offsets_buf, offset_type)[array.offset:array.offset + n + 1]
    out = aligned_empty(n, np.int64)
    data = data_buf.address if data_buf is not None else 0
    if n:
        _native()[64 if large else 32](offsets.ctypes.data, data, n, out.ctypes.data)
    return out


def _values(array: pa.Array, column: Column) -> np.ndarray:
    """A flat array's values as the column's dtype: a view where Arrow's type is that dtype."""
    t = array.type
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        return string_ids(array)
    values = np.frombuffer(array.buffers()[1], _NUMPY[str(t)])[array.offset:array.offset + len(array)]
    return values if values.dtype == column.dtype else _converted(values, column.dtype)


def column_arrays(array: pa.Array, column: Column) -> Tuple[np.ndarray, ...]:
    """(values,) of a scalar or fixed-size list column ([n] or [n, k]); (values, row_splits) of a
    ragged one. `array` has no nulls (checked by the reader)."""
    if column.kind in ("id", "float"):
        return (_values(array, column),)
    flat = array.flatten()  # the child values of this slice of the list array, zero-copy
    values = _values(flat, column)
    if column.fixed:
        return (values.reshape(len(array), column.fixed),)
    if pa.types.is_fixed_size_list(array.type):  # declared ragged (a stream's list columns are)
        splits = aligned_empty(len(array) + 1, np.int64)
        np.multiply(np.arange(len(array) + 1, dtype=np.int64), array.type.list_size, out=splits)
        return values, splits
    offsets = array.offsets.to_numpy()
    return values, _converted(offsets - offsets[0], np.dtype(np.int64))


def null_column(table: pa.Table, columns: Sequence[Column]) -> str:
    """The first declared column with a missing value (a list's values included), or ''."""
    for c in columns:
        chunked = table.column(c.name)
        if chunked.null_count:
            return c.name
        if c.kind in ("ids", "floats") and any(chunk.flatten().null_count for chunk in chunked.chunks):
            return c.name
    return ""


def stack_columns(members: Sequence[np.ndarray]) -> np.ndarray:
    """Equal-length 1-D arrays of one dtype (4 or 8 bytes) as the columns of one aligned
    row-major array [rows, len(members)], stacked natively a row at a time."""
    first = members[0]
    out = aligned_empty((len(first), len(members)), first.dtype)
    if not len(first):
        return out
    contiguous = [np.ascontiguousarray(m) for m in members]
    pointers = (ctypes.c_void_p * len(contiguous))(*(m.ctypes.data for m in contiguous))
    if _native()["stack"](pointers, len(contiguous), len(first), first.dtype.itemsize, out.ctypes.data):
        raise TypeError(f"stack_columns: {first.dtype} values; 4- or 8-byte values are stacked")
    return out


def batch_arrays(table: pa.Table, columns: Sequence[Column]) -> Dict[str, np.ndarray]:
    """`table`'s rows as flat arrays by output name: name, or name/values and name/row_splits for
    a ragged column, or a group's name for its members stacked (into one aligned array: the
    group's one copy). One chunk a column is a view; more are joined (a copy). The reader makes
    them once a row group (pyarrow's buffers cost microseconds a column) and cuts batches from
    them with the functions below."""
    out: Dict[str, np.ndarray] = {}
    groups: Dict[str, List[np.ndarray]] = {}
    for c in columns:
        chunked = table.column(c.name)
        array = chunked.chunk(0) if chunked.num_chunks == 1 else chunked.combine_chunks()
        arrays = column_arrays(array, c)
        if c.group:
            groups.setdefault(c.group, []).append(arrays[0])  # declared() lists a group's members in slot order
        elif c.ragged:
            out[c.name + "/values"], out[c.name + "/row_splits"] = arrays
        else:
            out[c.name] = arrays[0]
    for group, members in groups.items():
        out[group] = stack_columns(members)
    return out


def declared(columns: Mapping[str, Any], owner: str) -> List[Tuple[str, str, str, int, int]]:
    """The user's {output: kind, or (kind, [scalar columns stacked as output])}, checked, in its
    order, as (column, kind, group, slot, width) a column."""
    if not isinstance(columns, Mapping) or not columns:
        raise TypeError(f"{owner}: parameter 'columns' must be a non-empty dict of column name to kind "
                        f"({', '.join(map(repr, KINDS))}), or of a name to (kind, [columns]), got {columns!r}")
    out: List[Tuple[str, str, str, int, int]] = []
    seen = set()

    def named(name):
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"{owner}: column name {name!r} must be a non-empty str without '/'")
        if name in seen:
            raise ValueError(f"{owner}: column {name!r} is declared twice")
        seen.add(name)
        return name

    for name, kind in columns.items():
        members: Sequence[str] = ()
        if isinstance(kind, tuple) and len(kind) == 2 and isinstance(kind[1], (list, tuple)):
            kind, members = kind
            if kind not in ("id", "float") or not members:
                raise ValueError(f"{owner}: group {name!r} is ({kind!r}, {list(members)!r}); a group stacks one or "
                                 "more scalar columns: ('id', [names]) or ('float', [names])")
        if kind not in KINDS:
            raise ValueError(f"{owner}: column {name!r} is declared {kind!r}; allowed kinds: "
                             f"{', '.join(map(repr, KINDS))}, or a group ('id' or 'float', [columns])")
        if members:
            named(name)
            out += [(named(m), kind, name, i, len(members)) for i, m in enumerate(members)]
        else:
            out.append((named(name), kind, "", 0, 0))
    return out


def ragged_outputs(columns: Sequence[Column]) -> List[str]:
    """The names of the ragged outputs (each name/values and name/row_splits)."""
    return [c.name for c in columns if c.ragged]


def _dense_keys(arrays: Mapping[str, np.ndarray], ragged: Sequence[str]) -> List[str]:
    parts = {f"{name}/{part}" for name in ragged for part in ("values", "row_splits")}
    return [k for k in arrays if k not in parts]


def cut_arrays(arrays: Mapping[str, np.ndarray], ragged: Sequence[str], start: int, stop: int) -> Dict[str, np.ndarray]:
    """Rows [start, stop) of batch_arrays() output: views, but a ragged output's row splits (made
    anew from 0)."""
    out = {k: arrays[k][start:stop] for k in _dense_keys(arrays, ragged)}
    for name in ragged:
        splits = arrays[name + "/row_splits"]
        lo = splits[start]
        out[name + "/values"] = arrays[name + "/values"][lo:splits[stop]]
        out[name + "/row_splits"] = splits[start:stop + 1] if lo == 0 and start == 0 else \
            _converted(splits[start:stop + 1] - lo, np.dtype(np.int64))
    return out


def take_arrays(arrays: Mapping[str, np.ndarray], ragged: Sequence[str], order: np.ndarray) -> Dict[str, np.ndarray]:
    """The rows `order` of batch_arrays() output, gathered into aligned arrays (a shuffled
    batch's copy); a ragged output's lists moved whole, with no Python per row."""
    out = {}
    for k in _dense_keys(arrays, ragged):
        a = arrays[k]
        out[k] = aligned_empty((len(order),) + a.shape[1:], a.dtype)
        np.take(a, order, axis=0, out=out[k])
    for name in ragged:
        splits, values = arrays[name + "/row_splits"], arrays[name + "/values"]
        lengths = (splits[1:] - splits[:-1])[order]
        new = aligned_empty(len(order) + 1, np.int64)
        new[0] = 0
        np.cumsum(lengths, out=new[1:])
        source = np.repeat(splits[:-1][order] - new[:-1], lengths) + np.arange(new[-1], dtype=np.int64)
        out[name + "/values"] = aligned_empty(len(source), values.dtype)
        np.take(values, source, out=out[name + "/values"])
        out[name + "/row_splits"] = new
    return out


def join_arrays(parts: Sequence[Mapping[str, np.ndarray]], ragged: Sequence[str]) -> Dict[str, np.ndarray]:
    """batch_arrays() outputs one after another, joined into aligned arrays (a copy)."""
    out = {}
    for k in _dense_keys(parts[0], ragged):
        pieces = [p[k] for p in parts]
        out[k] = aligned_empty((sum(len(a) for a in pieces),) + pieces[0].shape[1:], pieces[0].dtype)
        np.concatenate(pieces, axis=0, out=out[k])
    for name in ragged:
        values = [p[name + "/values"] for p in parts]
        out[name + "/values"] = aligned_empty(sum(len(v) for v in values), values[0].dtype)
        np.concatenate(values, out=out[name + "/values"])
        splits = [p[name + "/row_splits"] for p in parts]
        joined = aligned_empty(sum(len(a) - 1 for a in splits) + 1, np.int64)
        joined[0], at, base = 0, 1, 0
        for a in splits:
            joined[at:at + len(a) - 1] = a[1:] - a[0] + base
            at, base = at + len(a) - 1, base + int(a[-1] - a[0])
        out[name + "/row_splits"] = joined
    return out
