"""Variable-length ids pooled on the owner, under real mpiexec on 1, 2 and 3 ranks, against
tf.nn.embedding_lookup_sparse on a plain tf.Variable with the same initial rows trained over the
same global batches (tests/mpi_jobs/pooled_oracle.py): every combiner, with and without weights,
empty examples and ids repeated within an example, SGD and lazy Adam, with admission and with
expansion, with static shapes (send_count), ragged / sparse / graph-modified input."""
import functools
import json
import glob
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from admission_oracle import Model as AdmissionModel
from mpi_helpers import check, mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "mpi_jobs"))
import pooled_oracle as job  # noqa: E402

# Every combiner with and without weights, each optimizer, each input form, admission and expansion.
CONFIGS = ["ragged-sum-now-sgd", "sparse-mean-now-sgd", "graph-sqrtn-now-sgd",
           "sparse-sum-w-sgd", "graph-mean-w-sgd", "ragged-sqrtn-w-sgd",
           "graph-sum-now-lazy_adam", "ragged-mean-now-lazy_adam", "sparse-sqrtn-now-lazy_adam",
           "ragged-sum-w-lazy_adam", "sparse-mean-w-lazy_adam", "graph-sqrtn-w-lazy_adam",
           "ragged-mean-w-sgd-admission", "graph-sum-w-lazy_adam-admission", "sparse-mean-w-sgd-eviction",
           "sparse-sqrtn-w-sgd-expansion", "ragged-mean-now-lazy_adam-expansion",
           "ragged-sum-w-sgd-static", "graph-mean-now-lazy_adam-static",
           "ragged-mean-w-lazy_adam-tablewise", "graph-sum-now-sgd-tablewise",
           "sparse-sqrtn-w-lazy_adam-replicated", "graph-mean-now-sgd-replicated",
           "ragged-sum-w-sgd-admission-replicated", "ragged-mean-w-lazy_adam-columnwise",
           "graph-sum-now-sgd-columnwise", "sparse-sqrtn-w-sgd-admission-columnwise",
           "ragged-sum-now-lazy_adam-expansion-columnwise", "graph-mean-w-sgd-static-columnwise",
           "graph-mean-w-sgd-static-tablewise", "sparse-mean-w-sgd-eviction-columnwise"]
RANKS = (1, 2, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for n in RANKS:
        d = tmp_path_factory.mktemp(f"pooled{n}")
        check(mpiexec(n, "pooled_oracle.py", d, *CONFIGS, timeout=900))
        out[n] = d
    return out


def shardrec_rows(directory, config, n):
    paths = sorted(glob.glob(os.path.join(directory, f"{config}-rank*-of{n}.npz")))
    assert len(paths) == n
    rows = {}
    for path in paths:
        part = np.load(path)
        assert int(part["steps"]) == job.STEPS
        if "expansion" in config and len(part["keys"]):
            assert int(part["capacity"]) > 8, "the table grew past its first capacity"
        start, stop = part["columns"].tolist()  # a column-wise table's slice: its columns of each row
        for key, row in zip(part["keys"].tolist(), part["rows"]):
            if key in rows and stop - start == job.DIM:  # only a replicated table's rows are on two ranks, alike
                assert "replicated" in config, f"key {key} on two ranks"
                np.testing.assert_array_equal(rows[key], row, err_msg=f"{config}: replicas of key {key} differ")
            rows.setdefault(key, np.full(job.DIM, np.nan, np.float32))[start:stop] = row
    return rows


def _lazy_adam(rows, grad, touched, state, t, lr, b1=0.9, b2=0.999, eps=1e-8):
    m, v = state
    m[touched] = b1 * m[touched] + (1 - b1) * grad[touched]
    v[touched] = b2 * v[touched] + (1 - b2) * grad[touched] ** 2
    rows = rows.copy()
    rows[touched] -= lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m[touched] / (np.sqrt(v[touched]) + eps)
    return rows


@functools.lru_cache(maxsize=None)
def oracle_rows(config):
    """Plain TensorFlow: embedding_lookup_sparse on a variable with a row per key (0.1 everywhere, as
    the table's initializer), over the global batches; with admission, a key reads zeros and stays
    untrained until admission_oracle.py says it has a row."""
    _, combiner, weighted, opt, *extra = config.split("-")
    ids, weights, splits, y = job.global_data()
    keys = np.unique(ids)
    positions = np.searchsorted(keys, ids)
    evicts = "eviction" in extra
    admission = AdmissionModel(job.ACCESS, job.EVICT_AGE if evicts else 10**9) if evicts or "admission" in extra \
        else None
    with tf.Graph().as_default():
        var = tf.compat.v1.Variable(np.full((len(keys), job.DIM), 0.1, np.float32), use_resource=True)
        held = tf.compat.v1.placeholder(tf.float32, [len(keys)])
        idx = tf.compat.v1.sparse_placeholder(tf.int64)
        w = tf.compat.v1.sparse_placeholder(tf.float32)
        target = tf.compat.v1.placeholder(tf.float32, [job.GLOBAL_BATCH])
        emb = tf.nn.embedding_lookup_sparse(var * held[:, None], idx, w if weighted == "w" else None, combiner=combiner)
        # TensorFlow's op drops trailing examples with no ids; shardrec gives every example a row.
        emb = tf.pad(emb, [[0, job.GLOBAL_BATCH - tf.shape(emb)[0]], [0, 0]])
        loss = tf.reduce_sum(tf.square(tf.reduce_sum(emb * job.PROJECTION, 1) - target)) / job.GLOBAL_BATCH
        grad = tf.convert_to_tensor(tf.gradients(loss, [var])[0])
        lr = job.LEARNING_RATES[opt]
        state = (np.zeros((len(keys), job.DIM), np.float32), np.zeros((len(keys), job.DIM), np.float32))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            rows = sess.run(var)
            for step in range(job.STEPS):
                first, last = step * job.GLOBAL_BATCH, (step + 1) * job.GLOBAL_BATCH
                lo, hi = splits[first], splits[last]
                example = np.repeat(np.arange(job.GLOBAL_BATCH), np.diff(splits[first:last + 1]))
                column = np.arange(hi - lo) - (splits[first:last][example] - lo)
                index = np.stack([example, column], 1)
                shape = [job.GLOBAL_BATCH, job.MAX_IDS]
                mask = np.ones(len(keys), np.float32)
                if evicts and step > 0 and step % job.EVICT_EVERY == 0:
                    held_before = set(admission.rows)
                    admission.evict(step)
                    gone = np.searchsorted(keys, sorted(held_before - set(admission.rows)))
                    rows[gone] = 0.1  # an evicted key admitted again starts from the initializer
                    sess.run(var.assign(rows))
                if admission is not None:
                    batch = [ids[splits[e]:splits[e + 1]] for e in range(first, last)]
                    admission.step(batch, np.full(job.GLOBAL_BATCH, step * job.SECONDS_PER_BATCH, np.int64))
                    mask = np.isin(keys, list(admission.rows)).astype(np.float32)
                feed = {idx: (index, positions[lo:hi], shape), w: (index, weights[lo:hi], shape),
                        target: y[first:last], held: mask}
                g = sess.run(grad, feed)
                touched = np.unique(positions[lo:hi][mask[positions[lo:hi]] > 0])
                if opt == "sgd":
                    rows[touched] -= lr * g[touched]
                else:
                    rows = _lazy_adam(rows, g, touched, state, step + 1, lr)
                sess.run(var.assign(rows))
    held_keys = keys if admission is None else np.array(sorted(admission.rows))
    assert admission is None or admission.rejected > 0, "some ids read zeros until their key was admitted"
    assert not evicts or admission.evicted, "keys were evicted"
    return {k: rows[np.searchsorted(keys, k)] for k in held_keys.tolist()}


@pytest.mark.parametrize("n", RANKS)
@pytest.mark.parametrize("config", CONFIGS)
def test_pooled_lookup_trains_as_embedding_lookup_sparse(runs, config, n):
    expected = oracle_rows(config)
    ours = shardrec_rows(runs[n], config, n)
    assert ours.keys() == expected.keys(), "the table holds exactly the keys the oracle trained (admitted ones)"
    moved = max(np.abs(r - 0.1).max() for r in expected.values())
    assert moved > 0.02, "training moved the rows"
    tolerance = 1e-6 if "sgd" in config else 1e-5
    for key, row in expected.items():
        np.testing.assert_allclose(ours[key], row, atol=tolerance, rtol=0, err_msg=f"{config} on {n} ranks, key {key}")


def test_estimator_mode_trains_evaluates_predicts_and_serves_the_export_alike(tmp_path):
    """Estimator mode on 2 ranks (a ragged_batch input_fn, graph modification by GraphModifierHook);
    rank 0's SavedModel (stock lookups pooled in the graph, SparseTensor inputs) serves what
    Estimator.predict predicted for the same examples."""
    check(mpiexec(2, "pooled_estimator.py", tmp_path / "model", tmp_path / "export", tmp_path / "out", timeout=400))
    ranks = [json.loads((tmp_path / f"out-rank{r}.json").read_text()) for r in range(2)]
    for out in ranks:
        assert out["metrics"]["global_step"] == 30
        assert out["metrics"]["auc"] > 0.75, "the pooled tags (the label's signal) were learned"
        assert len(out["pred_probs"]) == 128
    assert ranks[1]["served"] is None
    np.testing.assert_allclose(ranks[0]["served"], ranks[0]["pred_probs"], atol=1e-5)


@pytest.fixture
def ragged_batch(runtime):
    from shardrec.rank_runtime import FeatureSpec, create_table, get_asc_insert_func

    ids = tf.ragged.constant([[1, 2], [], [3, 3, 4]], dtype=tf.int64)
    weights = tf.ragged.constant([[1.0, 2.0], [], [1.0, 1.0, 3.0]])
    spec = FeatureSpec("ids", table_name="t")
    data = tf.data.Dataset.from_tensor_slices({"ids": ids, "w": weights}).ragged_batch(3)
    batch = tf.compat.v1.data.make_one_shot_iterator(data.map(get_asc_insert_func([spec]))).get_next()
    table = create_table(tf.int64, 4, "t", tf.compat.v1.zeros_initializer(), device_vocabulary_size=10)
    return table, spec, batch


BAD = [
    (dict(combiner="max"), ValueError, r"parameter 'combiner' is 'max'; allowed: 'sum', 'mean', 'sqrtn'"),
    (dict(weights=lambda: tf.ones([3, 2])), ValueError,
     r"weights of shape \(3, 2\) differ from the ids' \(None,\) \(flat\)"),
    (dict(weights=np.ones(3)), TypeError, r"parameter 'weights' is a ndarray; allowed: a RaggedTensor or SparseTensor"),
    (dict(serving_default_value=1.0), ValueError, r"serving_default_value applies to lookups of one row per id"),
]


@pytest.mark.parametrize("kwargs,exc,message", BAD)
def test_bad_pooled_lookup_arguments_are_named(ragged_batch, kwargs, exc, message):
    from shardrec.rank_runtime import sparse_lookup

    table, spec, batch = ragged_batch
    kwargs = {k: v() if callable(v) else v for k, v in kwargs.items()}
    with pytest.raises(exc, match=message):
        sparse_lookup(table, spec, batch=batch, **kwargs)


def test_weights_shaped_otherwise_than_the_ids_are_refused_when_the_batch_runs(ragged_batch):
    from shardrec.rank_runtime import sparse_lookup, start_asc_pipeline

    table, spec, batch = ragged_batch
    other = tf.RaggedTensor.from_row_lengths(batch["w"].flat_values, [1, 1, 3])
    emb = sparse_lookup(table, spec, batch=batch, weights=other)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(tf.errors.InvalidArgumentError,
                           match=r"weights must have the ids\\?' shape \(the same ids per"):
            sess.run(emb)


def test_ragged_ids_without_graph_modification_or_a_feature_spec_are_refused(ragged_batch):
    from shardrec.rank_runtime import sparse_lookup

    table, _, batch = ragged_batch
    with pytest.raises(TypeError, match=r"'ids' is a RaggedTensor, which needs modify_graph=True .* pass the "
                                        r"FeatureSpec whose dataset key holds the variable-length ids"):
        sparse_lookup(table, batch["ids"], batch=batch)


def test_a_combiner_or_weights_with_dense_ids_are_refused(runtime):
    from shardrec.rank_runtime import FeatureSpec, create_table, get_asc_insert_func, sparse_lookup

    spec = FeatureSpec("ids", table_name="t")
    data = tf.data.Dataset.from_tensor_slices({"ids": np.arange(6).reshape(3, 2)}).batch(3)
    batch = tf.compat.v1.data.make_one_shot_iterator(data.map(get_asc_insert_func([spec]))).get_next()
    table = create_table(tf.int64, 4, "t", tf.compat.v1.zeros_initializer(), device_vocabulary_size=10)
    with pytest.raises(ValueError, match=r"'combiner' pools variable-length ids .* leave combiner out"):
        sparse_lookup(table, spec, batch=batch, combiner="sum")
    with pytest.raises(ValueError, match=r"'weights' weighs variable-length ids .* leave weights out"):
        sparse_lookup(table, spec, batch=batch, weights=tf.ones([3, 2]))


def test_ragged_ids_of_a_float_dtype_or_deeper_nesting_are_refused(runtime):
    from shardrec.rank_runtime import FeatureSpec, get_asc_insert_func

    spec = FeatureSpec("ids", table_name="t")
    cases = ((tf.ragged.constant([[1.0], [2.0, 3.0]]), r"ids of dtype float32; ids must be int32 or int64"),
             (tf.ragged.constant([[[1]], [[2, 3], [4]]], dtype=tf.int64),
              r"variable-length ids of shape \(None, None, None\); allowed: \[batch, \(ids per example\)\]"))
    for ids, message in cases:
        data = tf.data.Dataset.from_tensor_slices({"ids": ids}).ragged_batch(2)
        with pytest.raises(TypeError, match=message):
            data.map(get_asc_insert_func([spec]))
