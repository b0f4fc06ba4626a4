"""Sparse Adagrad (accum += g^2; row -= lr * g / sqrt(accum)): one fused pass over the distinct rows."""
import tensorflow as tf

from ..embedding import native_ops
from ..validation import check_number
from .base import SparseOptimizerMixin, check_learning_rate


class SparseAdagrad(SparseOptimizerMixin, tf.compat.v1.train.AdagradOptimizer):
    def _resource_apply_sparse(self, grad, var, indices):
        lr = tf.cast(self._learning_rate_tensor, tf.float32)
        return native_ops.load().shardrec_sparse_apply_adagrad(var.handle, self.get_slot(var, "accumulator").handle,
                                                               indices, grad, lr, self._rounding_step(var))


def create_hash_optimizer(learning_rate: float = 0.001, initial_accumulator_value: float = 0.9, use_locking: bool = False,
                          name: str = "Adagrad") -> "SparseAdagrad":
    owner = "adagrad.create_hash_optimizer"
    lr = check_learning_rate(owner, learning_rate)
    acc = check_number(owner, "initial_accumulator_value", initial_accumulator_value, 0, 1, lo_open=True)
    return SparseAdagrad(lr, initial_accumulator_value=acc, use_locking=use_locking, name=name)
