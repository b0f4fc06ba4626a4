"""How a table holds its numbers: ``create_table(value_dtype=..., slot_dtype=..., stochastic_rounding=...)``.

Values may be float32, float16 or bfloat16. Optimizer slots stay float32 unless ``slot_dtype`` is
bfloat16: a slot such as Adam's second moment (the square of a gradient, often below 1e-8) or
Adagrad's and FTRL's accumulators needs float32's exponent range, which bfloat16 has and float16
does not (its smallest normal number is 6e-5), so float16 is not offered for slots. Arithmetic is
float32 in every case; a 16-bit row is rounded when an optimizer writes it back, stochastically
unless ``stochastic_rounding=False`` (then to the nearest, as TensorFlow casts).

``exchange_dtype`` (float32 unless bfloat16 or float16) is how the table's rows and row gradients
cross between ranks in the row exchange: each value rounded to the nearest 16-bit value before it
is sent (a rank's own block too, so a row reads the same whichever rank owns it), half the bytes,
as TorchRec's quantized communications. With value_dtype the same 16-bit type the rows lose
nothing forward; the gradients are rounded once, per requester and row, before the owner sums
them. A job of one rank exchanges nothing and rounds nothing.
"""
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from ..validation import check_dtype, check_type

# The row store's format numbers (native/src/storage/row_format.h).
FORMATS = {tf.float32: 0, tf.float16: 1, tf.bfloat16: 2}
VALUE_DTYPES = EXCHANGE_DTYPES = (tf.float32, tf.float16, tf.bfloat16)
SLOT_DTYPES = (tf.float32, tf.bfloat16)


@dataclass(frozen=True)
class RowDtypes:
    values: tf.DType = tf.float32
    slots: tf.DType = tf.float32
    stochastic_rounding: bool = True
    exchange: tf.DType = tf.float32

    @property
    def wire(self) -> str:
        """The row exchange op's `wire` attribute."""
        return self.exchange.name

    @property
    def values_format(self) -> int:
        return FORMATS[self.values]

    @property
    def slots_format(self) -> int:
        return FORMATS[self.slots]

    @property
    def compact(self) -> bool:
        """Whether any column is 16-bit."""
        return self.values != tf.float32 or self.slots != tf.float32


def row_dtypes(owner: str, value_dtype: Any, slot_dtype: Any, stochastic_rounding: Any,
               exchange_dtype: Any = None) -> RowDtypes:
    """The checked choice; slot_dtype and exchange_dtype None: float32."""
    values = check_dtype(owner, "value_dtype", value_dtype, VALUE_DTYPES)
    slots = tf.float32 if slot_dtype is None else check_dtype(owner, "slot_dtype", slot_dtype, SLOT_DTYPES)
    check_type(owner, "stochastic_rounding", stochastic_rounding, bool, "a bool")
    exchange = tf.float32 if exchange_dtype is None else check_dtype(owner, "exchange_dtype", exchange_dtype,
                                                                        EXCHANGE_DTYPES)
    return RowDtypes(values, slots, stochastic_rounding, exchange)
