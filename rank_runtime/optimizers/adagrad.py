"""Sparse Adagrad on TensorFlow's ResourceSparseApplyAdagrad kernel."""
import tensorflow as tf

from ..validation import check_number
from .base import SparseOptimizerMixin, check_learning_rate


class SparseAdagrad(SparseOptimizerMixin, tf.compat.v1.train.AdagradOptimizer):
    pass


def create_hash_optimizer(learning_rate=0.001, initial_accumulator_value=0.9, use_locking=False, name="Adagrad"):
    owner = "adagrad.create_hash_optimizer"
    lr = check_learning_rate(owner, learning_rate)
    acc = check_number(owner, "initial_accumulator_value", initial_accumulator_value, 0, 1, lo_open=True)
    return SparseAdagrad(lr, initial_accumulator_value=acc, use_locking=use_locking, name=name)
