"""What every sparse optimizer shares: it takes IndexedSlices gradients of table variables, drops
the sentinel row (ids with no row), and leaves the per-row update to TensorFlow's sparse kernels.

Duplicate rows in one gradient (the same key looked up by several features, or asked by several
ranks) are summed by TensorFlow's ``_resource_apply_sparse_duplicate_indices`` before the update.
"""
import tensorflow as tf

from .. import config
from ..table import EmbeddingTable, table_of_variable
from ..validation import check_number


def check_learning_rate(owner, learning_rate):
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
            pairs.append((self._drop_sentinel(grad, table), table.variable))
        if not pairs:
            raise ValueError(f"{type(self).__name__}: no gradient for any table")
        return pairs

    @staticmethod
    def _drop_sentinel(grad, table):
        indices = tf.cast(grad.indices, tf.int32)
        keep = tf.not_equal(indices, table.sentinel)
        values = tf.boolean_mask(grad.values, keep)
        if table.all2all_gradients_op == "sum_gradients_and_div_by_ranksize":
            values = values / float(config.get_rank_size())
        return tf.IndexedSlices(values, tf.boolean_mask(indices, keep), grad.dense_shape)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        return super().apply_gradients(self._table_pairs(grads_and_vars), global_step=global_step, name=name)

    def compute_gradients(self, loss, var_list=None, **kwargs):
        if var_list is None:
            var_list = tf.compat.v1.get_collection("SHARDREC_SPARSE_TABLES")
        var_list = [v.variable if isinstance(v, EmbeddingTable) else v for v in var_list]
        return super().compute_gradients(loss, var_list=var_list, **kwargs)
