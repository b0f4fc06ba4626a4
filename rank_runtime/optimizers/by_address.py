"""The Rec SDK's by-address optimizers (the user guide's "Model Adaptation": dynamic capacity expansion): gradients are taken
of each lookup's local rows and applied to the rows at their addresses.

With init(use_dynamic_expansion=True), every training lookup puts its local rows (the distinct
rows this rank gathers as owner, before the row exchange) in the graph collection
ASCEND_SPARSE_LOOKUP_LOCAL_EMB and their addresses (the rows' numbers in the table's row store,
int64, fixed for a row's life) in ASCEND_SPARSE_LOOKUP_ID_OFFSET, in the same order. A script then
does ``opt.apply_gradients(zip(tf.gradients(loss, local_embs), addresses))``. Here that becomes
the table's ordinary sparse update (the same fused kernels): the gradient of a lookup's local rows
is the IndexedSlices gradient of the table at those addresses.
"""
from typing import Any
import tensorflow as tf

from ..process import config
from ..validation import check_number
from .adagrad import SparseAdagrad
from .base import check_learning_rate
from .gradient_descent import SparseGradientDescent
from .lazy_adam import LazyAdam, check_adam_parameters

# The graph collections that scripts written for the Rec SDK read.
ASCEND_SPARSE_LOOKUP_LOCAL_EMB = "ASCEND_SPARSE_LOOKUP_LOCAL_EMB"
ASCEND_SPARSE_LOOKUP_ID_OFFSET = "ASCEND_SPARSE_LOOKUP_ID_OFFSET"

def record_lookup(table: Any, local_rows: tf.Tensor, addresses: tf.Tensor) -> None:
    """Called by sparse_lookup with dynamic expansion: files a lookup's rows and addresses."""
    tf.compat.v1.add_to_collection(ASCEND_SPARSE_LOOKUP_LOCAL_EMB, local_rows)
    tf.compat.v1.add_to_collection(ASCEND_SPARSE_LOOKUP_ID_OFFSET, addresses)
    table.record_address_lookup(addresses, local_rows)


def _lookup_of(owner, addresses):
    if isinstance(addresses, tf.Tensor):
        for table in config.get_config().tables.values():
            local_rows = table.local_rows_at(addresses)
            if local_rows is not None:
                return table, local_rows
    raise TypeError(f"{owner}: {addresses!r} is not an address tensor of a lookup; pass the tensors of "
                    f"tf.get_collection({ASCEND_SPARSE_LOOKUP_ID_OFFSET!r}), in the same order as their local rows")


def _require_expansion(owner):
    if not config.get_config().use_dynamic_expansion:
        raise ValueError(f"{owner}: the by-address optimizers need dynamic capacity expansion "
                         "(init(use_dynamic_expansion=True)); without it use the optimizer's create_hash_optimizer")


class _ByAddress:
    """Mixed in front of a sparse optimizer: apply_gradients takes (gradient of local rows, addresses)."""

    def _decayed(self, grad, local_rows):
        return grad

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        owner = f"{type(self).__name__}.apply_gradients"
        _require_expansion(owner)
        by_table = {}
        for grad, addresses in grads_and_vars:
            table, local_rows = _lookup_of(owner, addresses)
            if grad is None:
                continue
            grad = self._decayed(tf.convert_to_tensor(grad), local_rows)
            by_table.setdefault(table, []).append((grad, addresses))
        pairs = []
        for table, parts in by_table.items():
            shape = tf.shape(table.variable, out_type=tf.int64)
            if len(parts) == 1:
                values, indices = parts[0]
            else:
                # Several lookups of one table: their rows may repeat, and the optimizer sums them.
                values = tf.concat([g for g, _ in parts], 0)
                indices = tf.concat([a for _, a in parts], 0)
            pairs.append((tf.IndexedSlices(values, indices, shape), table.variable))
        return super().apply_gradients(pairs, global_step=global_step, name=name)


class LazyAdamByAddress(_ByAddress, LazyAdam):
    pass


class AdagradByAddress(_ByAddress, SparseAdagrad):
    pass


class GradientDescentByAddr(_ByAddress, SparseGradientDescent):
    def __init__(self, learning_rate, weight_decay, use_locking, name):
        super().__init__(learning_rate, use_locking=use_locking, name=name)
        self._weight_decay = weight_decay

    def _decayed(self, grad, local_rows):
        # row -= lr * (grad + weight_decay * row), the rows as this step read them.
        return grad + self._weight_decay * local_rows if self._weight_decay else grad


def lazy_adam(learning_rate: float = 0.001, beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8,
              name: str = "LazyAdamByAddress"):
    owner = "lazy_adam_by_addr.create_hash_optimizer_by_address"
    _require_expansion(owner)
    lr, b1, b2, eps = check_adam_parameters(owner, learning_rate, beta1, beta2, epsilon)
    return LazyAdamByAddress(lr, beta1=b1, beta2=b2, epsilon=eps, name=name)


def adagrad(learning_rate: float = 0.001, initial_accumulator_value: float = 0.9, name: str = "Adagrad"):
    owner = "adagrad_by_addr.create_hash_optimizer_by_address"
    _require_expansion(owner)
    lr = check_learning_rate(owner, learning_rate)
    acc = check_number(owner, "initial_accumulator_value", initial_accumulator_value, 0, 1, lo_open=True)
    return AdagradByAddress(lr, initial_accumulator_value=acc, name=name)


def gradient_descent(learning_rate: float, weight_decay: float = 0.0001, use_locking: bool = False,
                     name: str = "GradientDescentByAddr"):
    owner = "gradient_descent_by_addr.create_hash_optimizer_by_addr"
    _require_expansion(owner)
    lr = check_learning_rate(owner, learning_rate)
    decay = check_number(owner, "weight_decay", weight_decay, 0, 1)
    return GradientDescentByAddr(lr, decay, use_locking, name)
