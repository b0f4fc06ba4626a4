"""Sparse tables: ``create_table`` and the per-rank shard it returns.

A shard is a native row store (row_store.py) with the native index that maps keys to its rows. Its
values, and each optimizer slot, are a column of the store, which TensorFlow sees as a resource
variable of ``rows + 1`` rows whose tensor is that column (bound by the variable's initializer):
TensorFlow's gradients, the sparse optimizers' fused kernels and Saver work on it as on any
variable, while the rows stay where the native core put them. The extra last row is the sentinel:
it stays zero and is what a key with no row (unknown at evaluation, padding in static shapes) reads.
"""
import re
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Optional

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from ..process import config
from . import export_view, native_ops, placing
from ..process.logs import get_logger, warn_once
from .row_dtypes import RowDtypes, row_dtypes
from ..formats.sharding_plan import COLUMN_WISE, REPLICATED, ROW_WISE, Placement, TablePlan
from .placing import replica_initial
from .row_store import make_store
from .tiers import SsdTier, TierCounters, ssd_paths, swap_policy
from ..validation import check_choice, check_int, check_number, check_type
from ..process.world import get_world

log = get_logger("shardrec.table")

SPARSE_TABLES_COLLECTION = "SHARDREC_SPARSE_TABLES"
# Optimizer slot variables of tables (Adam's m and v, ...): saved with their table, per rank.
SPARSE_SLOTS_COLLECTION = "SHARDREC_SPARSE_SLOTS"
MAX_LOOKUPS_PER_TABLE = 128
_NAME_RE = re.compile(r"[A-Za-z0-9_.]{1,100}")
# The node attribute that lists which outputs of an op are distinct rows of a table (an internal
# attribute: TensorFlow keeps those beginning with '_' on a node and ignores them in its kernels).
DISTINCT_ROWS_ATTR = "_shardrec_distinct_rows"
_GRADIENT_OPS = ("sum_gradients", "sum_gradients_and_div_by_ranksize")


class EmbeddingTable:
    """One rank's shard of a sparse table."""

    def __init__(self, name, key_dtype, dim, capacity, device_vocabulary_size, emb_initializer,
                 init_param, is_save, all2all_gradients_op, expands=False, rank=0, ssd=None,
                 rows: RowDtypes = RowDtypes(), plan: TablePlan = TablePlan(Placement(ROW_WISE))):
        self.table_name = name
        # Where its keys live (formats/sharding_plan.py) and what the planner expected of it.
        self.plan = plan
        self.placement = plan.placement
        # How the store holds values and optimizer slots (row_dtypes.py).
        self.row_dtypes = rows
        self.key_dtype = key_dtype
        self.dim = dim
        # The columns this rank's store holds of each row: all of them, but for a column-wise
        # table, whose every rank holds dim / slices (its own slice, or none of the keys).
        self.row_dim = self.placement.row_dim(dim)
        self.held_columns = self.placement.columns_on(rank, dim)
        self.device_vocabulary_size = device_vocabulary_size
        self.vocabulary_rows = device_vocabulary_size  # with the host tier's (create_table sets it)
        self.is_save = is_save
        self.init_param = init_param
        self.all2all_gradients_op = all2all_gradients_op
        self.expands = expands
        self.emb_initializer = emb_initializer
        self.rank = rank
        # Admission and eviction (admission/thresholds.py), set when the key pipeline starts.
        self.thresholds = None
        from ...native import core as native_core  # links MPI: imported once init() has started it

        # The SSD tier (tiers.SsdTier, or None): the store's rows are then the memory tier.
        self.ssd = ssd
        self.store, rows = make_store(native_core, name, self.row_dim, capacity, expands, emb_initializer, init_param,
                                      rank,
                                      draws_natively=ssd is not None, values_format=self.row_dtypes.values_format,
                                      same_on_every_rank=self.placement.kind == REPLICATED)
        self.store.stochastic_rounding = self.row_dtypes.stochastic_rounding
        native_ops.register_store(self.store)
        weakref.finalize(self, native_ops.unregister_store, self.store)
        # The key index of a fixed table is sized for all its rows at once (no batch stalls on a
        # rehash); one that grows starts at a chunk's worth of keys and doubles, so that its memory,
        # too, follows the keys stored rather than the size the table was created with.
        expected = min(capacity, self.store.chunk_rows) if expands else capacity
        self.index = native_core.EmbeddingIndex(name, rows, self.store, expected, expands)
        if ssd is not None:
            ssd.attach(self.index, rank)
            # At exit too: a clean shutdown leaves nothing under ssd_data_path (checkpoints hold every row).
            weakref.finalize(self, ssd.close)
        self.lookup_count = 0
        # With dynamic expansion: a lookup's address tensor (ref) -> its local rows (by_address.py).
        self._address_lookups = {}
        self._init_ops = None
        self.graph = tf.compat.v1.get_default_graph()
        self.variable = self._make_variable(emb_initializer, rows)
        # "<optimizer name>.<slot name>" -> slot variable, rows aligned with self.variable.
        self.slots = {}
        # "values" and every slot name -> its column in the row store.
        self.columns = {"values": 0}
        # Names of the sparse optimizers that update this table in this graph (none: inference).
        self.optimizers = set()

    def add_lookup(self, owner: str) -> None:
        """One more lookup of this table (at most MAX_LOOKUPS_PER_TABLE)."""
        if self.lookup_count >= MAX_LOOKUPS_PER_TABLE:
            raise ValueError(f"{owner}: table {self.table_name!r} is already looked up {MAX_LOOKUPS_PER_TABLE} "
                             f"times; allowed: at most {MAX_LOOKUPS_PER_TABLE} lookups per table")
        self.lookup_count += 1

    def mark_distinct_rows(self, rows: tf.Tensor) -> None:
        """`rows` (a lookup's rows of this table, int32 or int64) holds each row once: a gradient over
        them goes to the fused update with no dedup. The key pipeline dedups a batch's rows on the
        owner, and the lookup's gather hands this very tensor to the gradient as its indices. Said
        on the op that makes `rows` (DISTINCT_ROWS_ATTR), so that it travels with the graph: copies
        of the graph (graph modification makes one), exports and imports keep it."""
        known = _distinct_outputs(rows.op)
        if rows.value_index not in known:
            value = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(i=known + [rows.value_index]))
            rows.op._set_attr(DISTINCT_ROWS_ATTR, value)  # noqa: SLF001 - TensorFlow's way to set a node attribute

    def record_address_lookup(self, addresses: tf.Tensor, local_rows: tf.Tensor) -> None:
        """A lookup's addresses (int64 rows of the store) and the local rows read there (by_address.py)."""
        self._address_lookups[addresses.ref()] = local_rows
        self.mark_distinct_rows(addresses)

    def local_rows_at(self, addresses: tf.Tensor) -> tf.Tensor:
        """The local rows of the lookup whose addresses are `addresses`, or None."""
        return self._address_lookups.get(addresses.ref())

    def set_thresholds(self, thresholds: Any) -> None:
        """Admission and eviction (admission/thresholds.py), set once when the key pipeline starts."""
        self.thresholds = thresholds
        self.index.set_admission(thresholds.access, thresholds.eviction)

    def add_optimizer(self, name: str) -> None:
        """A sparse optimizer named `name` updates this table in this graph."""
        self.optimizers.add(name)

    def init_ops(self) -> "TableInitOps":
        """This table's TableInitOps, made (while the graph can still change) for its current slots."""
        key = tuple(sorted(self.slots))
        if self._init_ops is None or self._init_ops.slots != key:
            self._init_ops = TableInitOps(self)
        return self._init_ops

    def register_slot(self, name: str, variable: tf.Variable) -> None:
        if not _NAME_RE.fullmatch(name) or ".." in name:
            raise ValueError(f"table {self.table_name!r}: optimizer slot {name!r} cannot name a checkpoint file; "
                             "optimizer names may use letters, digits, '_' and '.'")
        if self.slots.get(name, variable) is not variable:
            raise ValueError(f"table {self.table_name!r}: two optimizers named {name.split('.')[0]!r} update it; "
                             "give them different names")
        if name not in self.slots:
            self.slots[name] = variable
            tf.compat.v1.add_to_collection(SPARSE_SLOTS_COLLECTION, variable)

    def make_slot(self, name: str, variable_name: str, initial_value: float) -> tf.Variable:
        """A slot variable of the optimizer slot `name` ("<optimizer>.<slot>"): a column of the row
        store whose rows start at the scalar `initial_value`."""
        if name in self.slots:
            return self.slots[name]
        column = self.store.add_column(float(initial_value), self.row_dtypes.slots_format)
        variable = self._bound_variable(variable_name, column, None, [tf.compat.v1.GraphKeys.GLOBAL_VARIABLES],
                                        self.row_dtypes.slots)
        self.register_slot(name, variable)
        self.columns[name] = column
        return variable

    def _make_variable(self, emb_initializer, rows):
        if self.expands or self.ssd is not None:
            initial = None  # the native core draws rows as they come into use (or, with an SSD tier, per key)
        elif self.placement.kind == REPLICATED:
            def initial():
                return replica_initial(emb_initializer, self.table_name, [rows + 1, self.dim], self.init_param)
        else:
            def initial():
                # A column-wise slice takes its columns of whole rows drawn: an initializer whose scale
                # depends on the shape draws as for the whole table.
                values = emb_initializer([rows + 1, self.dim], dtype=tf.float32)
                if self.held_columns != slice(0, self.dim):
                    values = values[:, self.held_columns]
                # x * 1.0 is x: the ops left out are six a table of a wide model's graph.
                return values * tf.constant(self.init_param, tf.float32) if self.init_param != 1.0 else values
        return self._bound_variable(self.table_name, 0, initial,
                                    [tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, SPARSE_TABLES_COLLECTION],
                                    self.row_dtypes.values)

    def _bound_variable(self, name, column, initial, collections, dtype=tf.float32):
        """A resource variable of `dtype` whose tensor is `column` of the row store (bound by its
        initializer; `initial`, for the values of a fixed-size table, gives TensorFlow's float32
        initial values, which a 16-bit column takes to the nearest 16-bit number)."""
        shape = [self.store.rows, self.row_dim]
        # Not trainable: a dense optimizer must never touch a table (it would update every row);
        # the sparse optimizers find tables through their own collection. Host memory always: the
        # store is host memory and the op library's kernels are CPU kernels.
        _say_tables_stay_on_the_host()
        with tf.device("/cpu:0"):
            # Never run: the bind op below is the initializer (a float32 variable's initial value
            # is its input).
            empty = lambda: tf.raw_ops.Empty(shape=shape, dtype=dtype)  # noqa: E731
            variable = tf.compat.v1.Variable(
                initial if initial and dtype == tf.float32 else empty, name=name, trainable=False,
                use_resource=True, shape=shape, dtype=dtype, collections=collections)
            if not initial:
                given = tf.zeros([0, self.row_dim])
            else:
                given = variable.initial_value if dtype == tf.float32 else initial()
            variable._initializer_op = native_ops.store_bind(variable, self.store, column, given)
        return variable

    @property
    def sentinel(self) -> int:
        return self.index.sentinel

    def size(self) -> int:
        """Keys held by this rank's shard."""
        return self.index.size()

    def capacity(self) -> int:
        """Rows this rank's shard can hold in memory now: its fixed size, or with dynamic expansion
        the rows in use (they grow a chunk at a time as keys arrive, up to max_rows())."""
        return self.store.in_use if self.expands else self.index.capacity

    def max_rows(self) -> int:
        """Keys this rank's shard may ever hold: with dynamic expansion what its memory limit allows,
        with an SSD tier its memory rows and its SSD rows."""
        return self.index.max_keys

    def global_size(self, timeout: float = 60.0) -> int:
        """Keys held by all ranks together (a replicated table's, or a column-wise one's, once). Every
        rank must call it at the same point; a lone caller gets a TimeoutError instead of hanging the job."""
        total = get_world().sum_over_ranks(self.size(), f"table {self.table_name!r}: global_size()", timeout)
        # Every replica, and every slice of a column-wise table, holds each of its keys.
        copies = len(self.placement.ranks(get_world().size)) if self.placement.kind in (REPLICATED, COLUMN_WISE) else 1
        return total // copies

    def counters(self) -> "TableCounters":
        """This rank's counters (TableCounters)."""
        return TableCounters(index=self.index.counters(), size=self.size(), capacity=self.capacity(),
                             pending=self.index.pending(), held_back=self.index.held_back(),
                             index_bytes=self.index.memory_bytes(), store=self.store.bytes(), dim=self.row_dim,
                             bytes_per_row=self.store.bytes_per_row,
                             tier=self.ssd.counters(self.index) if self.ssd is not None else None)

    def admission_counters(self) -> "AdmissionCounters":
        """The counters of admission and eviction alone (the logs and the supervisor's summary)."""
        c = self.index.counters()
        return AdmissionCounters(admitted=c.admitted, rejected=c.rejected, evicted=c.evicted, reused=c.reused,
                                 pending=self.index.pending(), capacity=self.capacity())

    def beat_figures(self) -> "tuple[Optional[dict], Optional[dict]]":
        """What a heartbeat carries of the table besides its size: admission counters (a table with
        admission counts) and SSD tier counters (a table with a tier), each None otherwise."""
        counted = self.admission_counters().as_dict() if self.thresholds is not None and self.thresholds.counts else None
        return counted, self.ssd.counters(self.index).as_dict() if self.ssd is not None else None

    def export(self, sess: tf.compat.v1.Session) -> dict:
        """This rank's rows of the table in session `sess`: {"keys", "values", "<optimizer>.<slot>"...}
        as numpy arrays, rows aligned with keys, in row order. Every rank calls it for its own shard
        (no collective); shardrec-ckpt export gathers all ranks' rows from a checkpoint. A column-wise
        table's rank gives its columns of each row (self.held_columns; its checkpoint holds whole rows)."""
        from ..checkpoint.table_save import read_table_rows

        return read_table_rows(sess, self)

    def __repr__(self):
        return f"EmbeddingTable({self.table_name!r}, dim={self.dim}, size={self.size()}, capacity={self.capacity()})"


def _key_dtype(value):
    try:
        dtype = tf.as_dtype(value)
    except TypeError:
        dtype = None
    if dtype not in (tf.int64, tf.int32):
        raise TypeError(f"create_table: parameter 'key_dtype' must be tf.int64 or tf.int32, got {value!r}")
    return dtype


def _dim(value):
    if isinstance(value, tf.TensorShape):
        if value.rank != 1 or value[0] is None:
            raise ValueError(f"create_table: parameter 'dim' as a TensorShape must be 1-D and fully known, got {value}")
        value = int(value[0])
    return check_int("create_table", "dim", value, 1, 8192)


def check_table_name(owner: str, name: str) -> str:
    check_type(owner, "name", name, str, "a string")
    if not _NAME_RE.fullmatch(name) or ".." in name or set(name) == {"."}:
        raise ValueError(f"{owner}: parameter 'name' = {name!r} is not allowed; allowed: 1 to 100 characters "
                         "of letters, digits, '_' and '.', not '..'")
    return name


def _say_tables_stay_on_the_host():
    if tf.config.list_physical_devices("GPU"):
        warn_once("TensorFlow sees a GPU: shardrec's tables, their optimizer slots and their kernels stay in host "
                  "memory (the dense part of the model may use the GPU)", "shardrec.table")


def create_table(key_dtype, dim: int, name: str, emb_initializer, device_vocabulary_size: int = 1,
                 host_vocabulary_size: int = 0, ssd_vocabulary_size: int = 0, ssd_data_path=None, is_save: bool = True,
                 init_param: float = 1.0, all2all_gradients_op: str = "sum_gradients", value_dtype=tf.float32,
                 shard_num: int = 1, slot_dtype=None, stochastic_rounding: bool = True, sharding: Optional[str] = None,
                 sharding_rank: Any = None, sharding_group: Optional[str] = None, exchange_dtype=None,
                 **kwargs) -> "EmbeddingTable":
    """Creates a sparse table sharded over the ranks; each parameter's range is checked, and an
    out-of-range value raises naming the parameter, its value and what is allowed. value_dtype
    float16 or bfloat16 and slot_dtype bfloat16 hold rows in 16 bits; exchange_dtype bfloat16 or
    float16 sends its rows and gradients between ranks in 16 bits (row_dtypes.py). sharding:
    'row_wise', 'table_wise' (on sharding_rank, or the least loaded rank), 'replicated' or
    'column_wise' (the row's columns in equal slices on the consecutive ranks sharding_rank, a list
    such as [0, 1], or on those the planner picks); None:
    init(sharding_plan=)'s plan, the planner with sharding_plan='auto', else row-wise (placing.py).
    sharding_group: a name; the tables of one group are placed together (the first one made decides,
    the later ones take its placement: a table-wise group lives on one rank)."""
    owner = "create_table"
    export = export_view.view_of()
    if export is not None:  # a graph a serving export builds: the table's rows come from the checkpoint
        return export.table(name, _key_dtype(key_dtype), _dim(dim))
    cfg = config.get_config()
    key_dtype = _key_dtype(key_dtype)
    dim = _dim(dim)
    check_table_name(owner, name)
    if name in cfg.tables:
        raise ValueError(f"{owner}: a table named {name!r} already exists; table names must be unique")
    if not callable(emb_initializer):
        raise TypeError(f"{owner}: parameter 'emb_initializer' must be a TensorFlow initializer, got {emb_initializer!r}")
    device_vocabulary_size = check_int(owner, "device_vocabulary_size", device_vocabulary_size, 1, 10**9)
    host_vocabulary_size = check_int(owner, "host_vocabulary_size", host_vocabulary_size, 0, 10**10)
    ssd_vocabulary_size = check_int(owner, "ssd_vocabulary_size", ssd_vocabulary_size, 0, 10**10)
    if ssd_vocabulary_size > 0 and host_vocabulary_size == 0:
        raise ValueError(f"{owner}: ssd_vocabulary_size = {ssd_vocabulary_size} needs host_vocabulary_size > 0")
    if host_vocabulary_size > 0 and cfg.use_dynamic_expansion:
        raise ValueError(f"{owner}: host_vocabulary_size > 0 and dynamic expansion (init(use_dynamic_expansion=True)) "
                         "cannot be used together: a table either grows in memory or has a fixed memory budget "
                         "with an SSD tier below it")
    paths = ssd_paths(owner, name, ssd_data_path, ssd_vocabulary_size)
    check_type(owner, "is_save", is_save, bool, "a bool")
    init_param = check_number(owner, "init_param", init_param, -10, 10)
    check_choice(owner, "all2all_gradients_op", all2all_gradients_op, _GRADIENT_OPS)
    check_int(owner, "shard_num", shard_num, 1, 1)
    rows = row_dtypes(owner, value_dtype, slot_dtype, stochastic_rounding, exchange_dtype)
    if rows.compact and ssd_vocabulary_size > 0:
        raise ValueError(f"{owner}: 16-bit rows (value_dtype={rows.values.name}, slot_dtype={rows.slots.name}) and an "
                         "SSD tier (ssd_vocabulary_size > 0) cannot be used together; allowed with an SSD tier: "
                         "value_dtype=tf.float32")
    if kwargs:
        raise TypeError(f"{owner}: unknown parameter(s) {sorted(kwargs)}")
    plan = placing.placement_of(cfg, name, sharding, sharding_rank, device_vocabulary_size + host_vocabulary_size,
                                dim, 0, sharding_group, ssd_vocabulary_size > 0, rows.exchange.size)
    placement = plan.placement
    placing.check_placement(owner, name, placement, ssd_vocabulary_size > 0, dim)
    # On a CPU host the device and host tiers are both this process's memory: their sum is the
    # memory budget, whose rows the kernels read directly (no swap between the two).
    capacity = placement.rows_on(cfg.rank, cfg.size, device_vocabulary_size + host_vocabulary_size)
    ssd = None
    if ssd_vocabulary_size > 0:
        ssd = SsdTier(paths, placement.rows_on(cfg.rank, cfg.size, ssd_vocabulary_size), swap_policy())
    table = EmbeddingTable(name, key_dtype, dim, capacity, device_vocabulary_size, emb_initializer,
                           init_param, is_save, all2all_gradients_op, cfg.use_dynamic_expansion, cfg.rank, ssd, rows,
                           plan)
    table.vocabulary_rows = device_vocabulary_size + host_vocabulary_size  # the planner's rows
    cfg.tables[name] = table
    if ssd is not None:
        log.info("table %r: dim %d, %d rows per rank in memory (device + host vocabulary) and up to %d on SSD under "
                 "%s (%d ranks, swap policy %s)", name, dim, capacity, ssd.rows, list(paths), cfg.size, ssd.policy)
    elif table.expands:
        log.info("table %r: dim %d, grows from 0 rows per rank as keys arrive, up to %d (its memory limit; %d ranks)",
                 name, dim, table.max_rows(), cfg.size)
    else:
        log.info("table %r: dim %d, %d rows on this rank (%d ranks, %s)", name, dim, capacity, cfg.size,
                 placement.describe())
    if rows.compact:
        log.info("table %r: values in %s, optimizer slots in %s, %s rounding (bytes per row: "
                 "table.counters().bytes_per_row)", name, rows.values.name, rows.slots.name,
                 "stochastic" if rows.stochastic_rounding else "nearest")
    return table


def table_of_variable(variable: Any) -> "EmbeddingTable | None":
    """The table whose device tier is `variable`, or None."""
    if not config.is_initialized():
        return None
    for table in config.get_config().tables.values():
        if table.variable is variable:
            return table
    return None


def _distinct_outputs(op) -> list:
    try:
        return list(op.get_attr(DISTINCT_ROWS_ATTR))
    except ValueError:
        return []


def rows_are_distinct(indices: tf.Tensor) -> bool:
    """Whether `indices` are the distinct rows of one lookup of a table (mark_distinct_rows)."""
    return isinstance(indices, tf.Tensor) and indices.value_index in _distinct_outputs(indices.op)


class TableInitOps:
    """Graph ops that tell whether a table and its slots are initialised, and initialise them. A
    session restored from a checkpoint runs no init_op: tables and slots, which the dense checkpoint
    does not hold, are initialised by the restore when they are not yet."""

    def __init__(self, table):
        self.slots = tuple(sorted(table.slots))
        variables = [table.variable, *table.slots.values()]
        with tf.name_scope(f"shardrec_checkpoint/{table.table_name}"):
            self.initialized = [tf.raw_ops.VarIsInitializedOp(resource=v.handle) for v in variables]
            self.initializers = [v.initializer for v in variables]


@dataclass(frozen=True)
class AdmissionCounters:
    admitted: int  # keys given a row because their count reached the threshold
    rejected: int  # training occurrences of keys without a row yet
    evicted: int   # keys whose row eviction freed
    reused: int    # freed rows taken again
    pending: int   # keys counting towards admission
    capacity: int  # rows this rank's shard can hold in memory now

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TableCounters:
    """table.counters(): this rank's shard. `index` holds the native core's key counters (keys_sent and
    keys_received, own rank included; inserted, missed, erased; with admission admitted, rejected;
    with eviction evicted, evicted_pending, reused); `pending` keys count towards admission,
    `held_back` evicted rows may still be used by batches in flight; `tier` is the SSD tier's
    (TierCounters) or None. as_dict() is the flat view (logs, JSON)."""
    index: Any  # shardrec.native.core.IndexCounters
    size: int
    capacity: int
    pending: int
    held_back: int
    index_bytes: int
    store: Any  # shardrec.native.core.StoreBytes: values, slots, metadata
    dim: int
    bytes_per_row: int = 0  # memory of one row in use: values, every slot column, metadata
    tier: Optional[TierCounters] = None

    @property
    def key_bytes_sent(self) -> int:
        return 8 * self.index.keys_sent

    @property
    def key_bytes_received(self) -> int:
        return 8 * self.index.keys_received

    @property
    def row_bytes_sent(self) -> int:
        """Bytes of rows this rank sent back as owner: a row for every key it received."""
        return 4 * self.dim * self.index.keys_received

    @property
    def row_bytes_received(self) -> int:
        return 4 * self.dim * self.index.keys_sent

    def as_dict(self) -> dict:
        out = dict(self.index.as_dict(), size=self.size, capacity=self.capacity, pending=self.pending,
                   held_back=self.held_back, index_bytes=self.index_bytes, value_bytes=self.store.values,
                   slot_bytes=self.store.slots, metadata_bytes=self.store.metadata, bytes_per_row=self.bytes_per_row)
        if self.tier is not None:
            out.update(self.tier.as_dict())
        out.update(key_bytes_sent=self.key_bytes_sent, key_bytes_received=self.key_bytes_received,
                   row_bytes_sent=self.row_bytes_sent, row_bytes_received=self.row_bytes_received)
        return out
