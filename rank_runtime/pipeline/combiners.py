"""Combining the rows of variable-length ids per example, with tf.nn.embedding_lookup_sparse's
semantics: `sum`, `mean` (divided by the example's sum of weights) and `sqrtn` (by the square root
of its sum of squared weights); an example with no ids reads zeros (TensorFlow's op drops trailing
empty examples; here every example has its row); a repeated id adds twice.

Weights are data (tf-idf, counts, recency), not trained: they get no gradient."""
from typing import Any, Optional
import tensorflow as tf

from . import ragged_ids

COMBINERS = ("sum", "mean", "sqrtn")
_OWNER = "sparse_lookup"


def check_combiner(combiner: Optional[str], variable_length: bool) -> Optional[str]:
    """The combiner of a variable-length lookup ('mean' by default, as TensorFlow's); none otherwise."""
    if combiner is None:
        return "mean" if variable_length else None
    if not variable_length:
        raise ValueError(f"{_OWNER}: parameter 'combiner' pools variable-length ids (a RaggedTensor or SparseTensor, "
                         "or a FeatureSpec whose dataset key holds one); these ids are dense, with one row per id: "
                         "leave combiner out, or pass the ids as a RaggedTensor")
    if combiner not in COMBINERS:
        raise ValueError(f"{_OWNER}: parameter 'combiner' is {combiner!r}; allowed: {', '.join(map(repr, COMBINERS))}")
    return combiner


def checked_weights(weights: Any, ids: tf.RaggedTensor) -> Optional[tf.Tensor]:
    """Per-id float32 weights shaped as the ids (a RaggedTensor or SparseTensor like them, or their flat
    values), or None."""
    if weights is None:
        return None
    if ragged_ids.is_variable_length(weights):
        ragged = ragged_ids.as_ragged(weights, f"{_OWNER}: weights")
        same = tf.debugging.assert_equal(ragged.row_splits, tf.cast(ids.row_splits, ragged.row_splits.dtype),
                                         message=f"{_OWNER}: weights must have the ids' shape (the same ids per "
                                                 "example)")
        with tf.control_dependencies([same]):
            flat = tf.identity(ragged.flat_values)
    elif isinstance(weights, tf.Tensor):
        flat = weights
    else:
        raise TypeError(f"{_OWNER}: parameter 'weights' is a {type(weights).__name__}; allowed: a RaggedTensor or "
                        "SparseTensor shaped as the ids, or a 1-D tensor of one weight per id")
    if not (flat.dtype.is_floating or flat.dtype.is_integer):
        raise TypeError(f"{_OWNER}: weights of dtype {flat.dtype.name}; allowed: a float or integer dtype")
    given, expected = flat.shape, ids.flat_values.shape
    if given.rank is not None and (given.rank != 1 or not given.is_compatible_with(expected)):
        raise ValueError(f"{_OWNER}: weights of shape {given} differ from the ids' {expected} (flat); allowed: one "
                         "weight per id, shaped as the ids")
    if given.rank is None or given[0] is None:
        same = tf.debugging.assert_equal(tf.size(flat), tf.size(ids.flat_values),
                                         message=f"{_OWNER}: weights must have one weight per id")
        with tf.control_dependencies([same]):
            flat = tf.identity(flat)
    return tf.stop_gradient(tf.cast(flat, tf.float32))


def example_scale(ids: tf.RaggedTensor, weights: Optional[tf.Tensor], combiner: str) -> tf.Tensor:
    """Per example: what its sum of rows is multiplied by."""
    if combiner == "sum":
        return None
    w = tf.ones_like(ids.flat_values, tf.float32) if weights is None else weights
    if combiner == "sqrtn":
        w = w * w
    total = tf.math.unsorted_segment_sum(w, ids.value_rowids(), ids.nrows())
    if combiner == "sqrtn":
        total = tf.sqrt(total)
    return tf.math.divide_no_nan(tf.ones_like(total), total)


def combine_rows(rows_per_id: tf.Tensor, ids: tf.RaggedTensor, weights: Optional[tf.Tensor],
                 combiner: str) -> tf.Tensor:
    """The same pooling over rows already looked up per id (the serving export's stock ops)."""
    if weights is not None:
        rows_per_id = rows_per_id * weights[:, None]
    out = tf.math.unsorted_segment_sum(rows_per_id, ids.value_rowids(), ids.nrows())
    factor = example_scale(ids, weights, combiner)
    return out if factor is None else out * factor[:, None]
