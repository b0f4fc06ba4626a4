"""A lookup of variable-length ids pooled on the owner (docs/internals/step.md, "Pooled lookups").

The owner gathers the distinct rows the batch asked it for, adds up, per (example, requester), the
rows it holds for that example (weighted), and sends one partial vector per pair; the requester
adds an example's partials and applies the combiner's scaling. What `tf.nn.embedding_lookup_sparse`
computes, with its semantics: `sum`, `mean` (divided by the example's sum of weights) and `sqrtn`
(by the square root of its sum of squared weights); an example with no ids reads zeros; a repeated
id adds twice (combiners.py). Gradients take the reverse path: the partials' gradient goes back on
the row exchange's gradient communicator, and each id's row receives its weight times its example's.
Weights cross to the owner once, in the forward pass.
"""
import tensorflow as tf

from ..embedding import native_ops
from . import combiners


def pooled_rows(ranks, rows, pool, ids, weights, combiner, exchange, slices=1):
    """[examples, dim]: the pooled lookup's stages after the owner's distinct `rows` (lookup.py).
    `exchange(rows, send, recv[, wire])` moves rows between the ranks on a communicator of the lookup's
    own, in the table's exchange dtype unless `wire` says otherwise. slices: a column-wise table's,
    whose slice ranks each return the same partials of their columns, joined here side by side."""
    received = None
    if weights is not None:
        sent = tf.gather(weights, pool.occ_order)[:, None]
        # The user's weights cross as they are: only rows and gradients take the table's exchange dtype.
        received = sent if ranks == 1 else exchange(sent, pool.occ_send_splits, pool.occ_recv_splits, "float32")
        received = tf.reshape(received, [-1])
    # Gather, weigh and add per partial in one pass (native_ops.pooled_sum); so is its gradient.
    partials = native_ops.pooled_sum(rows, pool.occ_rows, pool.occ_segments, tf.reduce_sum(pool.partial_send_splits),
                                     received)
    if ranks > 1:
        partials = exchange(partials, pool.partial_send_splits, pool.partial_recv_splits)
    if slices > 1:
        width = rows.shape[-1]
        partials = tf.reshape(tf.transpose(tf.reshape(partials, [slices, -1, width]), [1, 0, 2]), [-1, slices * width])
    out = native_ops.pooled_sum(partials, pool.partial_index, pool.partial_examples, ids.nrows(out_type=tf.int32))
    factor = combiners.example_scale(ids, weights, combiner)
    return out if factor is None else out * factor[:, None]
