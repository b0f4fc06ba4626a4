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


def make_batches(num_batches, batch, fields, distinct, seed=0):
    """(keys [num_batches, batch, fields] int64, dense row ids of the same shape in [0, U),
    U = number of distinct keys that occur)."""
    rng = np.random.default_rng(seed)
    ranks = zipf_ranks(rng, num_batches * batch * fields, distinct).reshape(num_batches, batch, fields)
    seen, premapped = np.unique(ranks, return_inverse=True)
    return rank_to_key(ranks), premapped.reshape(ranks.shape).astype(np.int32), len(seen)
