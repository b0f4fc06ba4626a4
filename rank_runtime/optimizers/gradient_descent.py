"""Sparse SGD: row -= lr * grad, for looked-up rows only."""
import tensorflow as tf

from .base import SparseOptimizerMixin, check_learning_rate

_SGD = tf.compat.v1.train.GradientDescentOptimizer


class SparseGradientDescent(SparseOptimizerMixin, _SGD):
    # A scatter-add sums repeated rows by itself: no dedup to skip.
    _resource_apply_sparse_duplicate_indices = _SGD._resource_apply_sparse_duplicate_indices


def create_hash_optimizer(learning_rate, use_locking=False, name="GradientDescent"):
    lr = check_learning_rate("gradient_descent.create_hash_optimizer", learning_rate)
    return SparseGradientDescent(lr, use_locking=use_locking, name=name)
