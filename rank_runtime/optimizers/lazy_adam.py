"""Lazy Adam: only looked-up rows and their moments change; the bias correction uses the
optimizer's own step count t: row -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + epsilon).

TensorFlow's v1 Adam decays the moments of every row on every step (its cost grows with the
vocabulary), so the sparse update is written here with gather / scatter ops.
"""
import tensorflow as tf

from ..validation import check_number
from .base import SparseOptimizerMixin, check_learning_rate


class LazyAdam(SparseOptimizerMixin, tf.compat.v1.train.AdamOptimizer):
    def _resource_apply_sparse(self, grad, var, indices):
        beta1_power, beta2_power = self._get_beta_accumulators()
        dtype = var.dtype.base_dtype
        beta1 = tf.cast(self._beta1_t, dtype)
        beta2 = tf.cast(self._beta2_t, dtype)
        eps = tf.cast(self._epsilon_t, dtype)
        lr = tf.cast(self._lr_t, dtype) * tf.sqrt(1 - tf.cast(beta2_power, dtype)) / (1 - tf.cast(beta1_power, dtype))
        m = self.get_slot(var, "m")
        v = self.get_slot(var, "v")
        m_rows = beta1 * tf.gather(m, indices) + (1 - beta1) * grad
        v_rows = beta2 * tf.gather(v, indices) + (1 - beta2) * tf.square(grad)
        update_m = m.scatter_update(tf.IndexedSlices(m_rows, indices))
        update_v = v.scatter_update(tf.IndexedSlices(v_rows, indices))
        step = lr * m_rows / (tf.sqrt(v_rows) + eps)
        update_var = var.scatter_sub(tf.IndexedSlices(step, indices))
        return tf.group(update_var, update_m, update_v)


def create_hash_optimizer(learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8, use_locking=False,
                          name="LazyAdam"):
    owner = "lazy_adam.create_hash_optimizer"
    lr = check_learning_rate(owner, learning_rate)
    b1 = check_number(owner, "beta1", beta1, 0, 1, lo_open=True, hi_open=True)
    b2 = check_number(owner, "beta2", beta2, 0, 1)
    eps = check_number(owner, "epsilon", epsilon, 0, 1, lo_open=True)
    return LazyAdam(lr, beta1=b1, beta2=b2, epsilon=eps, use_locking=use_locking, name=name)
