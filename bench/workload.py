"""The benchmark's data: ids drawn with a Zipf-like law (exponent 1.1) from a fixed set of
distinct int64 keys spread over a 2^40 range. Deterministic under a seed."""
import numpy as np

KEY_RANGE = 2**40


def zipf_ranks(rng, n, distinct, exponent=1.1):
    """Ranks in [0, distinct) with P(r) ~ 1 / (r + 1)^exponent."""
    cdf = np.cumsum(np.arange(1, distinct + 1, dtype=np.float64) ** -exponent)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(n)), distinct - 1)


def rank_to_key(ranks):
    # An odd multiplier is a bijection mod 2^40: distinct ranks stay distinct keys, spread out.
    return (ranks.astype(np.int64) * 0x9E3779B97F % KEY_RANGE).astype(np.int64)


def aligned(array):
    """A copy of `array` whose data starts on a 64-byte boundary. A batch handed to TensorFlow by
    tf.numpy_function is adopted without a copy only when so aligned; numpy's own arrays are
    16-byte aligned, and every peer's feed then paid a copy of each batch (1.3 MB) in its step."""
    buf = np.empty(array.nbytes + 64, np.uint8)
    start = -buf.ctypes.data % 64
    out = buf[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def make_batches(num_batches, batch, fields, distinct, seed=0):
    """(keys [num_batches, batch, fields] int64, dense row ids of the same shape in [0, U),
    U = number of distinct keys that occur); each batch's data 64-byte aligned."""
    rng = np.random.default_rng(seed)
    ranks = zipf_ranks(rng, num_batches * batch * fields, distinct).reshape(num_batches, batch, fields)
    seen, premapped = np.unique(ranks, return_inverse=True)
    keys, rows = rank_to_key(ranks), premapped.reshape(ranks.shape).astype(np.int32)
    if (batch * fields * 4) % 64 == 0:  # every batch of both then starts on a boundary too
        keys, rows = aligned(keys), aligned(rows)
    return keys, rows, len(seen)


def batch_dataset(keys, rows):
    """The batches, cycled, as a tf.data dataset of {"ids", "rows", "ts"}. The arrays stay in numpy: as
    graph constants (from_tensor_slices) they cost every process seconds of graph building and
    session start-up (measured: 7 s of a 16 s start-up). The one-batch prefetch serves every peer
    alike."""
    import tensorflow as tf

    def batch_at(i):
        return keys[i % len(keys)], rows[i % len(keys)]

    def element(i):
        ids, rows_ = tf.numpy_function(batch_at, [i], [tf.int64, tf.int32], stateful=False)
        # "ts": the step number as the data's timestamp (seconds), for peers that evict by age.
        return {"ids": tf.ensure_shape(ids, keys.shape[1:]), "rows": tf.ensure_shape(rows_, rows.shape[1:]),
                "ts": tf.fill(keys.shape[1:2], i)}

    return tf.data.Dataset.range(2**62).map(element).prefetch(1)
