"""Sparse FTRL-Proximal, as TensorFlow's ResourceSparseApplyFtrl computes it, in one fused pass over
the distinct rows and their two slots."""
import tensorflow as tf

from ..embedding import native_ops
from ..validation import check_number
from .base import SparseOptimizerMixin, check_learning_rate


class SparseFtrl(SparseOptimizerMixin, tf.compat.v1.train.FtrlOptimizer):
    def _create_slots(self, var_list):
        # TensorFlow's accumulator initializer is a function; a table's slot starts at a constant.
        for v in var_list:
            self._get_or_make_slot_with_initializer(v, tf.compat.v1.constant_initializer(self._initial_accumulator_value),
                                                    v.shape, v.dtype, "accum", self._accum_name or self._name)
            self._zeros_slot(v, "linear", self._linear_name or self._name)

    def _resource_apply_sparse(self, grad, var, indices):
        dtype = tf.float32  # a 16-bit table's arithmetic, too
        return native_ops.load().shardrec_sparse_apply_ftrl(
            var.handle, self.get_slot(var, "accum").handle, self.get_slot(var, "linear").handle, indices, grad,
            tf.cast(self._learning_rate_tensor, dtype), tf.cast(self._l1_regularization_strength_tensor, dtype),
            tf.cast(self._adjusted_l2_regularization_strength_tensor, dtype), tf.cast(self._learning_rate_power_tensor, dtype),
            self._rounding_step(var))


def create_hash_optimizer(learning_rate: float = 0.001, learning_rate_power: float = -0.5,
                          initial_accumulator_value: float = 0.1, l1_regularization_strength: float = 0.0,
                          l2_regularization_strength: float = 0.0, use_locking: bool = False,
                          name: str = "Ftrl") -> "SparseFtrl":
    owner = "ftrl.create_hash_optimizer"
    lr = check_learning_rate(owner, learning_rate)
    power = check_number(owner, "learning_rate_power", learning_rate_power, None, 0)
    acc = check_number(owner, "initial_accumulator_value", initial_accumulator_value, 0, None)
    l1 = check_number(owner, "l1_regularization_strength", l1_regularization_strength, 0, 1e4)
    l2 = check_number(owner, "l2_regularization_strength", l2_regularization_strength, 0, 1e4)
    return SparseFtrl(lr, learning_rate_power=power, initial_accumulator_value=acc,
                      l1_regularization_strength=l1, l2_regularization_strength=l2,
                      use_locking=use_locking, name=name)
