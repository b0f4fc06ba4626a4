"""A deterministic, Criteo-like synthetic CTR data set: 13 dense and 26 categorical features.

Category values follow a heavy-tailed (Zipf-like) frequency per field, and the label really
depends on them: a hidden weight per value of 8 informative fields, plus a few dense features,
gives the click probability. Keys carry their field in the high 32 bits, so fields never collide.
"""
import functools

import numpy as np

NUM_DENSE = 13
NUM_CAT = 26
INFORMATIVE_FIELDS = (0, 2, 3, 5, 8, 11, 17, 23)


# The 26 categorical features' cardinalities in the Criteo Kaggle Display Advertising Challenge
# data (7 days, 45.8M samples) after the usual preprocessing: the values TorchRec's DLRM example
# passes for Kaggle (torchrec examples/dlrm/dlrm_main.py, --num_embeddings_per_feature) and Meta's
# DLRM reference uses as ln_emb for the Kaggle set (facebookresearch/dlrm). 33,762,577 in all.
KAGGLE_CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                        5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)


def vocab_sizes(seed=0):
    rng = np.random.default_rng(seed + 1)
    return rng.permutation(np.geomspace(8, 200_000, NUM_CAT).astype(np.int64))


@functools.lru_cache(maxsize=64)
def _zipf_cdf(vocab, exponent):
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -exponent)
    return cdf / cdf[-1]


def _zipf_values(rng, n, vocab, exponent=1.1):
    """Ranks drawn with P(rank r) ~ 1 / r^exponent over [0, vocab), scrambled so that frequent
    values are not small numbers."""
    drawn = np.minimum(np.searchsorted(_zipf_cdf(vocab, exponent), rng.random(n)), vocab - 1)
    return (drawn * 2654435761) % (2**32)


def _value_weight(values, field, seed):
    """The hidden weight of a value of an informative field: a hash of (seed, field, value)."""
    salted = values.astype(np.uint64) + np.uint64(field * 1000003 + seed + 1)
    h = (salted * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)
    return (h.astype(np.float64) / float(1 << 24) - 0.5) * 2.4


def make_dataset(num_samples, seed=0, sample_seed=None):
    """Returns a dict of numpy arrays: dense [N, 13] float32, cat [N, 26] int64, label [N] float32.

    `seed` fixes the hidden model (which values mean clicks); `sample_seed` the samples drawn from
    it, so train and held-out sets share one model but not their rows.
    """
    rng = np.random.default_rng(seed * 7919 + 17 if sample_seed is None else sample_seed)
    sizes = vocab_sizes(seed)
    cat = np.empty((num_samples, NUM_CAT), np.int64)
    logit = np.full(num_samples, -0.5)
    for f in range(NUM_CAT):
        values = _zipf_values(rng, num_samples, int(sizes[f]))
        cat[:, f] = (np.int64(f) << 32) | values.astype(np.int64)
        if f in INFORMATIVE_FIELDS:
            logit += _value_weight(values, f, seed)
    dense = np.log1p(rng.lognormal(mean=1.0, sigma=1.0, size=(num_samples, NUM_DENSE)))
    logit += dense_logit(dense, seed)
    label = (rng.random(num_samples) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return {"dense": dense.astype(np.float32), "cat": cat, "label": label}


def make_kaggle_shaped(num_samples, seed=0, sample_seed=None):
    """Criteo Kaggle-shaped samples: dense [N, 13] float32, cat [N, 26] int64 (field f's ids are
    Zipf-1.1 ranks over KAGGLE_CARDINALITIES[f], scrambled into [0, 2^32), one table a field),
    label [N] float32, and prob [N]: the planted model's click probability, whose AUC on the
    labels is the best any model can reach on them."""
    rng = np.random.default_rng(seed * 7919 + 23 if sample_seed is None else sample_seed)
    cat = np.empty((num_samples, NUM_CAT), np.int64)
    logit = np.full(num_samples, -1.0)
    for f, vocab in enumerate(KAGGLE_CARDINALITIES):
        values = _zipf_values(rng, num_samples, vocab)
        cat[:, f] = values
        if f in INFORMATIVE_FIELDS:
            logit += _value_weight(values, f, seed)
    dense = np.log1p(rng.lognormal(mean=1.0, sigma=1.0, size=(num_samples, NUM_DENSE)))
    logit += dense_logit(dense, seed)
    prob = 1 / (1 + np.exp(-logit))
    label = (rng.random(num_samples) < prob).astype(np.float32)
    return {"dense": dense.astype(np.float32), "cat": cat, "label": label, "prob": prob.astype(np.float32)}


def dense_logit(dense, seed=0):
    """The dense features' part of the hidden click logit: the best score any model that ignores
    the categorical features can reach (a bar that embeddings must clear)."""
    dense_weight = np.random.default_rng(seed).normal(0.0, 0.6, NUM_DENSE) * (np.arange(NUM_DENSE) < 5)
    return (dense - dense.mean(0)) @ dense_weight


def auc(labels, scores):
    """Area under the ROC curve by the rank-sum formula (ties get their mean rank)."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, np.float64)
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    # Mean rank for runs of equal scores.
    boundaries = np.flatnonzero(np.diff(sorted_scores)) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [len(scores)]])
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e + 1) / 2.0
    pos = labels.sum()
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def run_to_end(sess, initializer, fetches):
    """Runs `fetches` over an evaluation iterator from its start (`initializer`) to its end: each
    fetch's values of every batch, concatenated."""
    import tensorflow as tf

    sess.run(initializer)
    out = [[] for _ in fetches]
    while True:
        try:
            values = sess.run(fetches)
        except tf.errors.OutOfRangeError:
            return [np.concatenate(v) for v in out]
        for kept, value in zip(out, values):
            kept.append(value)
