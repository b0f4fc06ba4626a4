"""Sparse SGD: row -= lr * grad, for looked-up rows only."""
import tensorflow as tf

from .base import SparseOptimizerMixin, check_learning_rate


class SparseGradientDescent(SparseOptimizerMixin, tf.compat.v1.train.GradientDescentOptimizer):
    pass


def create_hash_optimizer(learning_rate, use_locking=False, name="GradientDescent"):
    lr = check_learning_rate("gradient_descent.create_hash_optimizer", learning_rate)
    return SparseGradientDescent(lr, use_locking=use_locking, name=name)
