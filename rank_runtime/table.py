"""Sparse tables: ``create_table`` and the per-rank shard it returns.

A shard is a native row store (row_store.py) with the native index that maps keys to its rows. Its
values, and each optimizer slot, are a column of the store, which TensorFlow sees as a resource
variable of ``rows + 1`` rows whose tensor is that column (bound by the variable's initializer):
TensorFlow's gradients, the sparse optimizers' fused kernels and Saver work on it as on any
variable, while the rows stay where the native core put them. The extra last row is the sentinel:
it stays zero and is what a key with no row (unknown at evaluation, padding in static shapes) reads.
"""
import math
import re
import weakref

import tensorflow as tf

from . import config, native_ops
from .logs import get_logger, warn_once
from .row_store import make_store
from .tiers import SsdTier, ssd_paths, swap_policy
from .validation import check_choice, check_int, check_number, check_type
from .world import get_world

log = get_logger("shardrec.table")

SPARSE_TABLES_COLLECTION = "SHARDREC_SPARSE_TABLES"
# Optimizer slot variables of tables (Adam's m and v, ...): saved with their table, per rank.
SPARSE_SLOTS_COLLECTION = "SHARDREC_SPARSE_SLOTS"
MAX_LOOKUPS_PER_TABLE = 128
_NAME_RE = re.compile(r"[A-Za-z0-9_.]{1,100}")
_GRADIENT_OPS = ("sum_gradients", "sum_gradients_and_div_by_ranksize")


class EmbeddingTable:
    """One rank's shard of a sparse table."""

    def __init__(self, name, key_dtype, dim, capacity, device_vocabulary_size, emb_initializer,
                 init_param, is_save, all2all_gradients_op, expands=False, rank=0, ssd=None):
        self.table_name = name
        self.key_dtype = key_dtype
        self.dim = dim
        self.device_vocabulary_size = device_vocabulary_size
        self.is_save = is_save
        self.init_param = init_param
        self.all2all_gradients_op = all2all_gradients_op
        self.expands = expands
        self.emb_initializer = emb_initializer
        self.rank = rank
        # Admission and eviction (admission/thresholds.py), set when the key pipeline starts.
        self.thresholds = None
        from ..native import core as native_core  # links MPI: imported once init() has started it

        # The SSD tier (tiers.SsdTier, or None): the store's rows are then the memory tier.
        self.ssd = ssd
        self.store, rows = make_store(native_core, name, dim, capacity, expands, emb_initializer, init_param, rank,
                                      draws_natively=ssd is not None)
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
        # Slot tensors of this table's lookups, whose values are distinct (see optimizers/base.py).
        self.distinct_slot_tensors = set()
        # With dynamic expansion: a lookup's address tensor (ref) -> its local rows (by_address.py).
        self.address_lookups = {}
        self.graph = tf.compat.v1.get_default_graph()
        self.variable = self._make_variable(emb_initializer, rows)
        # "<optimizer name>.<slot name>" -> slot variable, rows aligned with self.variable.
        self.slots = {}
        # "values" and every slot name -> its column in the row store.
        self.columns = {"values": 0}
        # Names of the sparse optimizers that update this table in this graph (none: inference).
        self.optimizers = set()

    def register_slot(self, name, variable):
        if not _NAME_RE.fullmatch(name) or ".." in name:
            raise ValueError(f"table {self.table_name!r}: optimizer slot {name!r} cannot name a checkpoint file; "
                             "optimizer names may use letters, digits, '_' and '.'")
        if self.slots.get(name, variable) is not variable:
            raise ValueError(f"table {self.table_name!r}: two optimizers named {name.split('.')[0]!r} update it; "
                             "give them different names")
        if name not in self.slots:
            self.slots[name] = variable
            tf.compat.v1.add_to_collection(SPARSE_SLOTS_COLLECTION, variable)

    def make_slot(self, name, variable_name, initial_value):
        """A slot variable of the optimizer slot `name` ("<optimizer>.<slot>"): a column of the row
        store whose rows start at the scalar `initial_value`."""
        if name in self.slots:
            return self.slots[name]
        column = self.store.add_column(float(initial_value))
        variable = self._bound_variable(variable_name, column, None, [tf.compat.v1.GraphKeys.GLOBAL_VARIABLES])
        self.register_slot(name, variable)
        self.columns[name] = column
        return variable

    def _make_variable(self, emb_initializer, rows):
        if self.expands or self.ssd is not None:
            initial = None  # the native core draws rows as they come into use (or, with an SSD tier, per key)
        else:
            def initial():
                return emb_initializer([rows + 1, self.dim], dtype=tf.float32) * tf.constant(self.init_param,
                                                                                             tf.float32)
        return self._bound_variable(self.table_name, 0, initial,
                                    [tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, SPARSE_TABLES_COLLECTION])

    def _bound_variable(self, name, column, initial, collections):
        """A resource variable whose tensor is `column` of the row store (bound by its initializer;
        `initial`, for the values of a fixed-size table, gives TensorFlow's initial values)."""
        shape = [self.store.rows, self.dim]
        # Not trainable: a dense optimizer must never touch a table (it would update every row);
        # the sparse optimizers find tables through their own collection. Host memory always: the
        # store is host memory and the op library's kernels are CPU kernels.
        _say_tables_stay_on_the_host()
        with tf.device("/cpu:0"):
            variable = tf.compat.v1.Variable(
                initial or (lambda: tf.raw_ops.Empty(shape=shape, dtype=tf.float32)), name=name, trainable=False,
                use_resource=True, shape=shape, dtype=tf.float32, collections=collections)
            given = variable.initial_value if initial else tf.zeros([0, self.dim])
            variable._initializer_op = native_ops.store_bind(variable, self.store, column, given)
        return variable

    @property
    def sentinel(self):
        return self.index.sentinel

    def size(self):
        """Keys held by this rank's shard."""
        return self.index.size()

    def capacity(self):
        """Rows this rank's shard can hold in memory now: its fixed size, or with dynamic expansion
        the rows in use (they grow a chunk at a time as keys arrive, up to max_rows())."""
        return self.store.in_use if self.expands else self.index.capacity

    def max_rows(self):
        """Keys this rank's shard may ever hold: with dynamic expansion what its memory limit allows,
        with an SSD tier its memory rows and its SSD rows."""
        return self.index.max_keys

    def global_size(self, timeout=60.0):
        """Keys held by all ranks together. Every rank must call it at the same point; a lone
        caller gets a TimeoutError instead of hanging the job."""
        return get_world().sum_over_ranks(self.size(), f"table {self.table_name!r}: global_size()", timeout)

    def counters(self):
        """This rank's counters: keys held and capacity, keys sent to owners and received as owner
        (own rank included), with the bytes of keys and rows they mean, inserted / missed / erased, and
        the bytes of the key index and of the rows in use (values, optimizer slots, metadata). With
        admission: admitted (keys given a row by their count), rejected (training occurrences of keys
        without a row yet), pending (keys counting towards admission); with eviction: evicted,
        evicted_pending (counting keys forgotten), reused (freed rows taken again), held_back (evicted
        rows that batches in flight may still use)."""
        store_bytes = self.store.bytes()
        c = dict(self.index.counters(), size=self.size(), capacity=self.capacity(), pending=self.index.pending(),
                 held_back=self.index.held_back(),
                 index_bytes=self.index.memory_bytes(), value_bytes=store_bytes["values"],
                 slot_bytes=store_bytes["slots"], metadata_bytes=store_bytes["metadata"])
        if self.ssd is not None:
            c.update(self.ssd.counters(self.index))
        c["key_bytes_sent"] = 8 * c["keys_sent"]
        c["key_bytes_received"] = 8 * c["keys_received"]
        c["row_bytes_sent"] = 4 * self.dim * c["keys_received"]
        c["row_bytes_received"] = 4 * self.dim * c["keys_sent"]
        return c

    def admission_counters(self):
        """The counters of admission and eviction alone (the logs and the supervisor's summary)."""
        c = self.index.counters()
        return {k: c[k] for k in ("admitted", "rejected", "evicted", "reused")} | {
            "pending": self.index.pending(), "capacity": self.capacity()}

    def export(self, sess):
        """This rank's rows of the table in session `sess`: {"keys", "values", "<optimizer>.<slot>"...}
        as numpy arrays, rows aligned with keys, in row order. Every rank calls it for its own shard
        (no collective); shardrec-ckpt export gathers all ranks' rows from a checkpoint."""
        from .saver import read_table_rows

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


def check_table_name(owner, name):
    check_type(owner, "name", name, str, "a string")
    if not _NAME_RE.fullmatch(name) or ".." in name or set(name) == {"."}:
        raise ValueError(f"{owner}: parameter 'name' = {name!r} is not allowed; allowed: 1 to 100 characters "
                         "of letters, digits, '_' and '.', not '..'")
    return name


def _say_tables_stay_on_the_host():
    if tf.config.list_physical_devices("GPU"):
        warn_once("TensorFlow sees a GPU: shardrec's tables, their optimizer slots and their kernels stay in host "
                  "memory (the dense part of the model may use the GPU)", "shardrec.table")


def create_table(key_dtype, dim, name, emb_initializer, device_vocabulary_size=1, host_vocabulary_size=0,
                 ssd_vocabulary_size=0, ssd_data_path=None, is_save=True, init_param=1.0,
                 all2all_gradients_op="sum_gradients", value_dtype=tf.float32, shard_num=1, **kwargs):
    """Creates a sparse table sharded over the ranks; each parameter's range is checked, and an
    out-of-range value raises naming the parameter, its value and what is allowed."""
    owner = "create_table"
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
    try:
        value_ok = tf.as_dtype(value_dtype) == tf.float32
    except TypeError:
        value_ok = False
    if not value_ok:
        raise TypeError(f"{owner}: parameter 'value_dtype' must be tf.float32, got {value_dtype!r}")
    check_int(owner, "shard_num", shard_num, 1, 1)
    if kwargs:
        raise TypeError(f"{owner}: unknown parameter(s) {sorted(kwargs)}")
    # On a CPU host the device and host tiers are both this process's memory: their sum is the
    # memory budget, whose rows the kernels read directly (no swap between the two).
    capacity = math.ceil((device_vocabulary_size + host_vocabulary_size) / cfg.size)
    ssd = None
    if ssd_vocabulary_size > 0:
        ssd = SsdTier(paths, math.ceil(ssd_vocabulary_size / cfg.size), swap_policy())
    table = EmbeddingTable(name, key_dtype, dim, capacity, device_vocabulary_size, emb_initializer,
                           init_param, is_save, all2all_gradients_op, cfg.use_dynamic_expansion, cfg.rank, ssd)
    cfg.tables[name] = table
    if ssd is not None:
        log.info("table %r: dim %d, %d rows per rank in memory (device + host vocabulary) and up to %d on SSD under "
                 "%s (%d ranks, swap policy %s)", name, dim, capacity, ssd.rows, list(paths), cfg.size, ssd.policy)
    elif table.expands:
        log.info("table %r: dim %d, grows from 0 rows per rank as keys arrive, up to %d (its memory limit; %d ranks)",
                 name, dim, table.max_rows(), cfg.size)
    else:
        log.info("table %r: dim %d, %d rows per rank (%d ranks)", name, dim, capacity, cfg.size)
    return table


def table_of_variable(variable):
    """The table whose device tier is `variable`, or None."""
    if not config.is_initialized():
        return None
    for table in config.get_config().tables.values():
        if table.variable is variable:
            return table
    return None


def distinct_slot_refs():
    """The slot tensors (as refs) of every lookup built so far."""
    if not config.is_initialized():
        return set()
    return set().union(*(table.distinct_slot_tensors for table in config.get_config().tables.values()))
