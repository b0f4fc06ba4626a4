"""Lazy Adam: only looked-up rows and their moments change; the bias correction uses the
optimizer's own step count t: row -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + epsilon).

TensorFlow's v1 Adam decays the moments of every row on every step (its cost grows with the
vocabulary); here one fused kernel updates each distinct row and its two moments in one pass.
"""
from typing import Any
import tensorflow as tf

from ..embedding import native_ops
from ..validation import check_number
from .base import SparseOptimizerMixin, check_learning_rate


class LazyAdam(SparseOptimizerMixin, tf.compat.v1.train.AdamOptimizer):
    def _prepare(self):
        """The step's hyperparameters once for every table it updates (per table, they were ten ops
        of each table's update: a model of many tables paid them each step)."""
        super()._prepare()
        beta1_power, beta2_power = self._get_beta_accumulators()
        dtype = tf.float32  # a 16-bit table's arithmetic, too
        self._shardrec_hyper = (
            tf.cast(self._lr_t, dtype) * tf.sqrt(1 - tf.cast(beta2_power, dtype)) / (1 - tf.cast(beta1_power, dtype)),
            tf.cast(self._beta1_t, dtype), tf.cast(self._beta2_t, dtype), tf.cast(self._epsilon_t, dtype))

    def _resource_apply_sparse(self, grad, var, indices):
        lr, beta1, beta2, eps = self._shardrec_hyper
        m = self.get_slot(var, "m")
        v = self.get_slot(var, "v")
        return native_ops.load().shardrec_sparse_apply_lazy_adam(var.handle, m.handle, v.handle, indices, grad, lr,
                                                                 beta1, beta2, eps, self._rounding_step(var))


def check_adam_parameters(owner: str, learning_rate: Any, beta1: Any, beta2: Any, epsilon: Any) -> tuple:
    return (check_learning_rate(owner, learning_rate), check_number(owner, "beta1", beta1, 0, 1, lo_open=True, hi_open=True),
            check_number(owner, "beta2", beta2, 0, 1), check_number(owner, "epsilon", epsilon, 0, 1, lo_open=True))


def create_hash_optimizer(learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                          epsilon: float = 1e-8, use_locking: bool = False, name: str = "LazyAdam") -> "LazyAdam":
    lr, b1, b2, eps = check_adam_parameters("lazy_adam.create_hash_optimizer", learning_rate, beta1, beta2, epsilon)
    return LazyAdam(lr, beta1=b1, beta2=b2, epsilon=eps, use_locking=use_locking, name=name)
