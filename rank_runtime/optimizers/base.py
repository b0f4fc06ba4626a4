"""What every sparse optimizer shares: it takes IndexedSlices gradients of table variables and
leaves the per-row update to TensorFlow's sparse kernels.

The rows of one lookup are distinct (the key pipeline dedups them on the owner), so a gradient
that comes from a single lookup goes straight to the update; one summed over several lookups of a
table may repeat rows and goes through TensorFlow's dedup (unique + segment sum) first.

The sentinel row (what ids with no row read: keys not admitted yet, unknown keys at evaluation,
padding) gets gradients too (a key waiting for admission reads it in training); the fused kernels
never update it, so it stays zero.
"""
from typing import Any, Optional
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import init_ops, init_ops_v2
from tensorflow.python.training import optimizer as optimizer_lib

from ..process import config
from ..embedding.table import SPARSE_TABLES_COLLECTION, EmbeddingTable, rows_are_distinct, table_of_variable
from ..validation import check_number


def _scalar_initial_value(initializer, owner):
    """The value every row of an optimizer slot starts at: slots are columns of the table's row
    store, filled by the native core."""
    if isinstance(initializer, (init_ops.Zeros, init_ops_v2.Zeros)):
        return 0.0
    if isinstance(initializer, (init_ops.Constant, init_ops_v2.Constant)) and np.ndim(initializer.value) == 0:
        return float(initializer.value)
    raise TypeError(f"{owner}: a sparse table's optimizer slot must start at a scalar constant, got {initializer!r}")


def check_learning_rate(owner: str, learning_rate: Any) -> float:
    return check_number(owner, "learning_rate", learning_rate, 0, 10)


class SparseOptimizerMixin:
    """Mixed in front of a tf.compat.v1.train optimizer class."""

    def _table_pairs(self, grads_and_vars):
        pairs = []
        for grad, var in grads_and_vars:
            table = var if isinstance(var, EmbeddingTable) else table_of_variable(var)
            if table is None:
                raise TypeError(f"{type(self).__name__}: {getattr(var, 'name', var)!r} is not a sparse table; "
                                "sparse optimizers update the variables of create_table only "
                                "(use a TensorFlow optimizer for dense variables)")
            if grad is None:
                continue
            if not isinstance(grad, tf.IndexedSlices):
                raise TypeError(f"{type(self).__name__}: the gradient of table {table.table_name!r} is dense; "
                                "take it with tf.gradients(loss, table_variables) from sparse_lookup outputs")
            pairs.append((self._scaled(grad, table), table.variable))
        if not pairs:
            raise ValueError(f"{type(self).__name__}: no gradient for any table")
        return pairs

    @staticmethod
    def _scaled(grad, table):
        if table.all2all_gradients_op != "sum_gradients_and_div_by_ranksize" or config.get_rank_size() == 1:
            return grad
        return tf.IndexedSlices(grad.values / float(config.get_rank_size()), grad.indices, grad.dense_shape)

    def _zeros_slot(self, var, slot_name, op_name):
        return self._get_or_make_slot_with_initializer(var, init_ops.Zeros(), var.get_shape(), var.dtype.base_dtype,
                                                       slot_name, op_name)

    def _get_or_make_slot_with_initializer(self, var, initializer, shape, dtype, slot_name, op_name):
        table = table_of_variable(var)
        if table is None:
            return super()._get_or_make_slot_with_initializer(var, initializer, shape, dtype, slot_name, op_name)
        named_slots = self._slot_dict(slot_name)
        key = optimizer_lib._var_key(var)
        if key not in named_slots:
            initial = _scalar_initial_value(initializer, type(self).__name__)
            named_slots[key] = table.make_slot(f"{self.get_name()}.{slot_name}", f"{table.table_name}/{op_name}",
                                               initial)
        return named_slots[key]

    def _resource_apply_sparse_duplicate_indices(self, grad, handle, indices, **kwargs):
        # The rows of one lookup are distinct (EmbeddingTable.mark_distinct_rows): no dedup.
        if rows_are_distinct(indices):
            return self._resource_apply_sparse(grad, handle, indices, **kwargs)
        return self._apply_repeated_rows(grad, handle, indices, **kwargs)

    def _apply_repeated_rows(self, grad, handle, indices, **kwargs):
        """A gradient summed over several lookups of a table: TensorFlow's dedup, then the update."""
        return super()._resource_apply_sparse_duplicate_indices(grad, handle, indices, **kwargs)

    def _rounding_step(self, var) -> tf.Tensor:
        """What seeds a 16-bit table's stochastic rounding: the global step before this update, so
        that a resumed job rounds as an uninterrupted one; -1 (the table's own count of updates)
        without one, and for a float32 table, which does not round."""
        table = table_of_variable(var)
        step = getattr(self, "_global_step_for_rounding", None)
        if step is None:
            step = tf.compat.v1.train.get_global_step()
        if table is None or not table.row_dtypes.compact or step is None:
            return tf.constant(-1, tf.int64)
        return tf.cast(step, tf.int64)

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: Optional[str] = None) -> tf.Operation:
        self._global_step_for_rounding = global_step
        pairs = self._table_pairs(grads_and_vars)
        op = super().apply_gradients(pairs, global_step=global_step, name=name)
        for _, var in pairs:
            table = table_of_variable(var)
            table.add_optimizer(self.get_name())
            for slot_name in sorted(self.get_slot_names()):
                slot = self.get_slot(var, slot_name)
                if slot is not None:
                    table.register_slot(f"{self.get_name()}.{slot_name}", slot)
        return op

    def compute_gradients(self, loss: tf.Tensor, var_list: Any = None, **kwargs: Any) -> list:
        if var_list is None:
            var_list = tf.compat.v1.get_collection(SPARSE_TABLES_COLLECTION)
        var_list = [v.variable if isinstance(v, EmbeddingTable) else v for v in var_list]
        return super().compute_gradients(loss, var_list=var_list, **kwargs)
