"""Small builders shared by the tests: a dataset of id batches run through the key pipeline."""
import numpy as np
import tensorflow as tf

from shardrec.rank_runtime import FeatureSpec, get_asc_insert_func


def batched_iterator(data, batch_size, specs, is_training=True):
    """An initializable iterator over `data` (dict of arrays) mapped by get_asc_insert_func."""
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(batch_size, drop_remainder=True)
    dataset = dataset.map(get_asc_insert_func(tgt_key_specs=specs, is_training=is_training)).prefetch(2)
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    return iterator, iterator.get_next()


def run_all(sess, iterator, fetches):
    """Runs `fetches` until the iterator ends; returns the list of results."""
    sess.run(iterator.initializer)
    out = []
    while True:
        try:
            out.append(sess.run(fetches))
        except tf.errors.OutOfRangeError:
            return out


def slot_row_initializer(shape, dtype=tf.float32, **_):
    """Row s holds the value s in every column: a lookup then reveals which row a key got."""
    rows, dim = shape
    return tf.tile(tf.cast(tf.range(rows)[:, None], dtype), [1, dim])


def first_seen_rank(stream):
    """Key -> order of its first appearance in `stream`: the rows a fresh table hands out."""
    _, first = np.unique(stream, return_index=True)
    order = np.argsort(np.argsort(first))
    keys = np.unique(stream)
    return dict(zip(keys.tolist(), order.tolist()))


__all__ = ["FeatureSpec", "batched_iterator", "first_seen_rank", "run_all", "slot_row_initializer"]
