"""A table shard's native row store (native/src/storage/row_store.h) as the table sees it: how many rows it
reserves, how far it may grow, and how new rows are drawn when the native core draws them.

A table of fixed size (the default) reserves its capacity and takes its initial values from
TensorFlow's own initializer, so they are exactly what a tf.Variable with that initializer holds.
With dynamic expansion (init(use_dynamic_expansion=True)) rows come into use a chunk at a time as
keys arrive, up to the table's memory limit, and the native core draws each chunk's values from
the same distribution as emb_initializer (its class and parameters; the values themselves differ
from TensorFlow's, whose draws depend on the whole variable's shape).
"""
import os
import re
import zlib
from dataclasses import dataclass

import psutil
from tensorflow.python.ops import init_ops, init_ops_v2

MEMORY_LIMIT_ENV = "SHARDREC_TABLE_MEMORY_LIMIT"
MAX_ROWS = 2**31 - 2
_SIZE_RE = re.compile(r"\s*(\d+)\s*([KMGT]?)i?B?\s*", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclass(frozen=True)
class RowInit:
    """What the native core draws a new row's values from: kind 0 constant a, 1 uniform [a, b),
    2 normal (mean a, stddev b), 3 truncated normal (mean a, stddev b, redrawn beyond 2 stddev)."""
    kind: int
    a: float = 0.0
    b: float = 0.0
    seed: int = 0


def memory_limit() -> int:
    """Bytes of rows (values, slots, metadata) one table may use on one rank with dynamic expansion:
    SHARDREC_TABLE_MEMORY_LIMIT (a number of bytes, suffixes K, M, G, T), else the host's memory."""
    text = os.environ.get(MEMORY_LIMIT_ENV)
    if text is None or not text.strip():
        return psutil.virtual_memory().total
    match = _SIZE_RE.fullmatch(text)
    if match is None or int(match.group(1)) == 0:
        raise ValueError(f"{MEMORY_LIMIT_ENV}={text!r} is not a memory size; allowed: a positive number of bytes, "
                         "optionally with K, M, G or T (for example 512M or 4G)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def _scalar(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def row_init(initializer, table_name: str, rank: int, why: str = "with dynamic expansion", per_rank: bool = True):
    """The native draw matching `initializer` for a table with dynamic expansion, or a ValueError
    naming the initializers that have one. Unseeded initializers get a seed from the table name, so
    that a restarted job draws the same rows. With dynamic expansion each rank draws its own; with
    an SSD tier a key's row is drawn from the key (so every rank and rank count draws the same)."""
    kind = type(initializer).__name__
    seed = getattr(initializer, "seed", None)
    seed = zlib.crc32(table_name.encode()) if seed is None else int(seed)
    seed = seed * 1_000_003 + (rank if per_rank else 0)
    if isinstance(initializer, (init_ops.Zeros, init_ops_v2.Zeros)) or kind == "Zeros":
        return RowInit(0, 0.0)
    if isinstance(initializer, (init_ops.Ones, init_ops_v2.Ones)) or kind == "Ones":
        return RowInit(0, 1.0)
    if kind == "Constant" and _scalar(getattr(initializer, "value", None)) is not None:
        return RowInit(0, _scalar(initializer.value))
    if kind == "RandomUniform":
        return RowInit(1, float(initializer.minval), float(initializer.maxval), seed)
    if kind == "RandomNormal":
        return RowInit(2, float(initializer.mean), float(initializer.stddev), seed)
    if kind == "TruncatedNormal":
        return RowInit(3, float(initializer.mean), float(initializer.stddev), seed)
    raise ValueError(f"create_table({table_name!r}): {why}, new rows are drawn by the native core, "
                     f"which knows these emb_initializers: zeros, ones, a scalar constant, random_uniform, "
                     f"random_normal, truncated_normal (tf.compat.v1 or Keras); got {initializer!r}")


def expanding_rows(dim: int, table_name: str, value_bytes: int = 4) -> int:
    """The rows a table with dynamic expansion reserves: as many as its memory limit could hold of
    values alone (reserving address space costs no memory)."""
    limit = memory_limit()
    rows = min(MAX_ROWS, limit // (value_bytes * dim))
    if rows < 1:
        raise ValueError(f"create_table({table_name!r}): {MEMORY_LIMIT_ENV} = {limit} bytes cannot hold one row of "
                         f"dim {dim}")
    return rows, limit


def make_store(native_core, name: str, dim: int, capacity: int, expands: bool, emb_initializer, init_param: float,
               rank: int, draws_natively: bool = False, values_format: int = 0, same_on_every_rank: bool = False) -> tuple:
    """(store, rows it may hold): the store of a fixed table (capacity rows) or of one that grows.
    draws_natively: a fixed table with an SSD tier, whose rows the native core draws per key.
    values_format: 0 float32, 1 float16, 2 bfloat16 (row_dtypes.py). same_on_every_rank: a replicated
    table's rows, drawn alike by every rank."""
    if not expands:
        init = row_init(emb_initializer, name, rank, "with an SSD tier", per_rank=False) if draws_natively else RowInit(0)
        return native_core.RowStore(name, dim, capacity + 1, 0, init.kind, init.a, init.b, init.seed & (2**64 - 1),
                                    float(init_param) if draws_natively else 1.0, values_format), capacity
    init = row_init(emb_initializer, name, rank, per_rank=not same_on_every_rank)
    rows, limit = expanding_rows(dim, name, 4 if values_format == 0 else 2)
    store = native_core.RowStore(name, dim, rows + 1, limit, init.kind, init.a, init.b, init.seed & (2**64 - 1),
                                 float(init_param), values_format)
    return store, rows
