"""Sparse SGD: row -= lr * grad, for looked-up rows only: one fused pass over a lookup's distinct
rows; a gradient with repeated rows (summed over lookups) is deduplicated first."""
import tensorflow as tf

from ..embedding import native_ops
from .base import SparseOptimizerMixin, check_learning_rate

_SGD = tf.compat.v1.train.GradientDescentOptimizer


class SparseGradientDescent(SparseOptimizerMixin, _SGD):
    def _apply_repeated_rows(self, grad, handle, indices, **kwargs):
        # Repeated rows summed (TensorFlow's dedup), then the fused kernel, which leaves the
        # sentinel row alone (TensorFlow's scatter-add would move it).
        return tf.compat.v1.train.Optimizer._resource_apply_sparse_duplicate_indices(self, grad, handle, indices,
                                                                                     **kwargs)

    def _resource_apply_sparse(self, grad, var, indices):
        lr = tf.cast(self._learning_rate_tensor, tf.float32)
        return native_ops.load().shardrec_sparse_apply_sgd(var.handle, indices, grad, lr, self._rounding_step(var))


def create_hash_optimizer(learning_rate: float, use_locking: bool = False,
                          name: str = "GradientDescent") -> SparseGradientDescent:
    lr = check_learning_rate("gradient_descent.create_hash_optimizer", learning_rate)
    return SparseGradientDescent(lr, use_locking=use_locking, name=name)
