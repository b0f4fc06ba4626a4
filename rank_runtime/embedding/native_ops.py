"""shardrec's TensorFlow op library (native/src/tf_ops/tf_*.cc, built by the set-up next to the pybind11
core as `shardrec/native/tf_ops*.so`): the sparse optimizers' fused apply kernels, a lookup's row
gathers with their gradient, and the binding of table variables to their native row stores.

Loaded on first use; a missing library, or one built against another TensorFlow, stops with an
error that says how to rebuild it instead of a bare dlopen message.
"""
import ctypes
import functools
import glob
import os
from dataclasses import dataclass, field
from typing import Any, Dict

import tensorflow as tf

REBUILD = "run the set-up again (`bash scripts/bootstrap.sh`, or any `make` target), which rebuilds it for the " \
          "installed TensorFlow"
KERNELS = ("shardrec_sparse_apply_sgd", "shardrec_sparse_apply_adagrad", "shardrec_sparse_apply_lazy_adam",
           "shardrec_sparse_apply_ftrl", "shardrec_row_gather", "shardrec_row_gather_grad", "shardrec_variable_row_gather",
           "shardrec_variable_row_gather_expanded", "shardrec_store_bind", "shardrec_row_alltoall",
           "shardrec_group_row_gather", "shardrec_group_rows_gather", "shardrec_group_restore",
           "shardrec_routing_unpack")


def library_path() -> str:
    from ... import native

    found = sorted(p for d in native.__path__ for p in glob.glob(os.path.join(d, "tf_ops*.so")))
    if not found:
        raise RuntimeError(f"shardrec's TensorFlow op library (tf_ops*.so) is not in {list(native.__path__)}: {REBUILD}")
    return found[-1]


@dataclass
class OpLibraries:
    libraries: Dict[str, object] = field(default_factory=dict)  # loaded into TensorFlow, by path


_STATE = OpLibraries()


def load(path: str | None = None) -> Any:
    """The op library's Python module (its ops as functions); `path` for tests."""
    path = path or library_path()
    if path not in _STATE.libraries:
        try:
            module = tf.load_op_library(path)
        except (tf.errors.NotFoundError, OSError) as e:
            raise RuntimeError(f"shardrec's TensorFlow op library {path} cannot be loaded into TensorFlow "
                               f"{tf.__version__} ({str(e).strip()}): {REBUILD}") from None
        missing = [k for k in KERNELS if not hasattr(module, k)]
        if missing:
            raise RuntimeError(f"{path} is not shardrec's op library for this version (no {', '.join(missing)}): "
                               f"{REBUILD}")
        _STATE.libraries[path] = module
    return _STATE.libraries[path]


@functools.lru_cache(maxsize=None)
def _c_library():
    """The same library as C functions (dlopen of the loaded file returns the loaded library)."""
    load()
    lib = ctypes.CDLL(library_path())
    for fn in (lib.shardrec_store_register, lib.shardrec_store_unregister):
        fn.argtypes, fn.restype = [ctypes.c_void_p], ctypes.c_int
    lib.shardrec_comm_register.argtypes = [ctypes.c_char_p, ctypes.c_int64]
    lib.shardrec_comm_register.restype = ctypes.c_int
    lib.shardrec_exchange_bytes_sent.argtypes = [ctypes.c_char_p]
    lib.shardrec_exchange_bytes_sent.restype = ctypes.c_int64
    return lib


def register_comm(exchange: str, handle: int) -> None:
    """The row exchange kernels named `exchange` use the communicator whose Fortran handle is `handle`."""
    _c_library().shardrec_comm_register(exchange.encode(), handle)


def exchange_bytes_sent(exchange: str) -> int:
    """Bytes the row exchange named `exchange` (RowExchangeName.rows or .gradients) sent to other
    ranks in this process so far."""
    return int(_c_library().shardrec_exchange_bytes_sent(exchange.encode()))


def register_store(store: Any) -> None:
    """Lets the op library's kernels find `store` (a native RowStore) by its address; it keeps the
    store alive until unregister_store."""
    _c_library().shardrec_store_register(store.address)


def unregister_store(store: Any) -> None:
    _c_library().shardrec_store_unregister(store.address)


def store_bind(variable: tf.Variable, store: Any, column: int, initial: tf.Tensor) -> tf.Operation:
    """The initializer of a table variable (or slot) bound to `column` of `store`."""
    return load().shardrec_store_bind(variable.handle, initial, store=store.address, column=column)


def variable_row_gather(variable: tf.Variable, index: tf.Tensor, ticket: tf.Tensor | None = None,
                        channel: int = 0, expand: tf.Tensor | None = None) -> tf.Tensor:
    """variable[index] for a table's 2-D resource variable, as float32, in parallel over the rows and
    reading ahead; with `expand` (int32), variable[index[expand]] in one pass. Its gradient is
    IndexedSlices over `index` itself (the expand's positions summed per row first). `ticket` ([1]
    int32, the key pipeline's batch on `channel`, a channel.Channel) tells the table's row store
    that the batch's rows are read (native/src/storage/residency.h)."""
    if ticket is None:
        ticket = tf.zeros([1], tf.int32)
    attrs = dict(dim=int(variable.shape[1]), channel=int(channel))
    if expand is None:
        return load().shardrec_variable_row_gather(variable.handle, index, ticket, **attrs)
    return load().shardrec_variable_row_gather_expanded(variable.handle, index, expand, ticket, **attrs)


def table_slices(table: tf.Tensor, values: tf.Tensor, rows: tf.Tensor) -> tf.IndexedSlices:
    """As TensorFlow's ResourceGather gradient (IndexedSlices of the table), with the key pipeline's
    row tensor itself as the indices (1-D already, so no reshape): the sparse optimizers recognise
    it as distinct rows (EmbeddingTable.mark_distinct_rows, optimizers/base.py)."""
    from tensorflow.python.ops import resource_variable_ops

    # The shape read when the step runs: a table with dynamic expansion outgrows its variable's static one.
    params_shape = resource_variable_ops.variable_shape(table)
    if values.shape.rank == 2 and rows.shape.rank == 1:  # [rows, dim] already: no reshape ops per table and step
        return tf.IndexedSlices(values, rows, params_shape)
    values = tf.reshape(values, tf.concat([tf.shape(rows), params_shape[1:]], 0))
    return tf.IndexedSlices(values, rows, params_shape)


@tf.RegisterGradient("ShardrecVariableRowGather")
def _distinct_rows_gather_grad(op, grad):
    return table_slices(op.inputs[0], grad, op.inputs[1]), None, None


@tf.RegisterGradient("ShardrecVariableRowGatherExpanded")
def _expanded_rows_gather_grad(op, grad):
    """The sum over the positions that read one distinct row, then that row's slice of the table."""
    rows, expand = op.inputs[1], op.inputs[2]
    summed = load().shardrec_row_gather_grad(grad, expand, tf.shape(rows, out_type=tf.int32))
    return table_slices(op.inputs[0], summed, rows), None, None, None


def group_row_gather(variables: list, index: list, expand: list, send_splits: list, tickets: list,
                     channel: int) -> "tuple[tf.Tensor, tf.Tensor]":
    """(the rows N tables send to each rank, by rank then table; the group's send splits):
    tf_group_ops.cc. Its gradient is each table's IndexedSlices (pipeline/table_groups.py, which
    knows which members a gradient lookup read)."""
    return load().shardrec_group_row_gather([v.handle for v in variables], index, expand, send_splits, tickets,
                                            dim=int(variables[0].shape[1]), channel=int(channel))


def routing_unpack(packed: tf.Tensor) -> list:
    """A feature's routing fields (rows, expand, send_splits, recv_splits, restore, ticket) from the
    one tensor the key pipeline filed (tf_routing_ops.cc; pipeline/routing.py)."""
    return load().shardrec_routing_unpack(packed)


def group_rows_gather(rows: list, expand: list, send_splits: list) -> "tuple[tf.Tensor, tf.Tensor]":
    """As group_row_gather from each table's distinct rows already read (dynamic expansion's
    training lookups, whose rows by address scripts take gradients of)."""
    return load().shardrec_group_rows_gather(rows, expand, send_splits)


def group_row_gather_grad(grad: tf.Tensor, index: list, expand: list, send_splits: list) -> list:
    """Per table, its distinct rows' gradients from the group's."""
    return load().shardrec_group_row_gather_grad(grad, index, expand, send_splits)


def group_restore(rows: tf.Tensor, recv_splits: list, restore: list) -> list:
    """Per table, its rows in batch order, from the rows a group's exchange brought back."""
    return load().shardrec_group_restore(rows, recv_splits, restore)


@tf.RegisterGradient("ShardrecGroupRestore")
def _group_restore_grad(op, *grads):
    n = op.get_attr("N")
    splits, restore = list(op.inputs[1:1 + n]), list(op.inputs[1 + n:1 + 2 * n])
    dim = tf.shape(op.inputs[0])[1:]
    filled = [g if g is not None else tf.zeros(tf.concat([tf.shape(r), dim], 0)) for g, r in zip(grads, restore)]
    return [load().shardrec_group_restore_grad(filled, splits, restore)] + [None] * (2 * n)


def row_alltoall(rows: tf.Tensor, send_splits: tf.Tensor, recv_splits: tf.Tensor, exchange: str, timeout_s: float,
                 gradient: str | None = None, wire: str = "float32") -> tf.Tensor:
    """Sends send_splits[r] rows to rank r and receives recv_splits[r] from it, on the communicator
    registered as `exchange` (world.py); returns the rows received, by rank. Its gradient sends the
    gradients back the same way on the exchange named `gradient` (required where a gradient is taken).
    wire: the values' dtype on the way, both ways ("float32", "bfloat16", "float16": row_dtypes.py)."""
    return load().shardrec_row_alltoall(rows, send_splits, recv_splits, exchange=exchange, timeout_s=timeout_s,
                                        gradient=gradient or "", wire=wire)


@tf.RegisterGradient("ShardrecRowAlltoall")
def _row_alltoall_grad(op, grad):
    gradient = op.get_attr("gradient").decode()
    if not gradient:
        raise LookupError(f"{op.name}: this row exchange was built without a gradient exchange (an evaluation "
                          "lookup); no gradient flows through it")
    # The way back: each rank returns what it received and receives what it sent.
    back = load().shardrec_row_alltoall(tf.convert_to_tensor(grad), op.inputs[2], op.inputs[1], exchange=gradient,
                                        timeout_s=op.get_attr("timeout_s"), wire=op.get_attr("wire").decode())
    return back, None, None


def row_gather(rows: tf.Tensor, index: tf.Tensor) -> tf.Tensor:
    """rows[index] for a 2-D float32 `rows`, in parallel over the output rows; its gradient is the
    dense sum per row of `rows` (what TensorFlow's gather + unsorted segment sum give)."""
    return load().shardrec_row_gather(rows, index)


@tf.RegisterGradient("ShardrecRowGather")
def _row_gather_grad(op, grad):
    rows, index = op.inputs
    return load().shardrec_row_gather_grad(grad, index, tf.shape(rows, out_type=tf.int32)), None



def pooled_sum(rows: tf.Tensor, index, segments, num_segments, weights=None) -> tf.Tensor:
    """out[segments[i]] += weights[i] * rows[index[i]], [num_segments, dim] (index or segments None:
    the identity; weights None: ones), in one pass; its gradient is the same sum the other way."""
    empty = tf.zeros([0], tf.int32)
    return load().shardrec_pooled_sum(rows, empty if index is None else index, empty if segments is None else segments,
                                      tf.cast(num_segments, tf.int32),
                                      tf.zeros([0], tf.float32) if weights is None else weights)


@tf.RegisterGradient("ShardrecPooledSum")
def _pooled_sum_grad(op, grad):
    rows, index, segments, _, weights = op.inputs
    back = load().shardrec_pooled_sum(grad, segments, index, tf.shape(rows, out_type=tf.int32)[0], weights)
    return back, None, None, None, None
