"""Each sparse optimizer against plain TensorFlow (or a numpy lazy Adam) training a dense
tf.Variable indexed by the same keys, on batches full of repeated keys."""
import numpy as np
import pytest
import tensorflow as tf

from mx_rec.optimizers import adagrad, ftrl, gradient_descent, lazy_adam
from pipeline_helpers import FeatureSpec, batched_iterator, run_all
from shardrec.rank_runtime.process import lifecycle
from shardrec.rank_runtime import create_table, get_dense_and_sparse_variable, sparse_lookup, start_asc_pipeline

pytestmark = pytest.mark.quick

STEPS, BATCH, FIELDS, DIM = 60, 8, 3, 4
POOL = np.array([-(2**40), -17, -3, -1, 0, 1, 2, 5, 9, 11, 2**33, 2**40 + 7, 99, 123456789, -987654321], np.int64)
WEIGHTS = np.random.default_rng(3).normal(size=(FIELDS, DIM)).astype(np.float32)


def make_data():
    rng = np.random.default_rng(11)
    # A skewed draw from a small pool: every batch repeats keys, within a row and across rows.
    ids = POOL[np.minimum(rng.geometric(0.25, size=(STEPS * BATCH, FIELDS)) - 1, len(POOL) - 1)]
    y = rng.normal(size=STEPS * BATCH).astype(np.float32)
    return {"ids": ids, "y": y}


def model_loss(emb, y):
    pred = tf.reduce_sum(emb * WEIGHTS, axis=[1, 2])
    return tf.reduce_mean(tf.square(pred - y))


def train_shardrec(make_optimizer, data, mode):
    """Returns (initial table rows, final rows, exported keys, their slots).

    mode "one_lookup": one feature; "two_lookups": the ids split into two features of the same
    table, so the table's gradient sums two lookups; "static": static shapes with padding."""
    with tf.Graph().as_default():
        lifecycle.init(use_dynamic=mode != "static")
        if mode == "two_lookups":
            data = {"a": data["ids"][:, :1], "b": data["ids"][:, 1:], "y": data["y"]}
            specs = [FeatureSpec("a", table_name="emb"), FeatureSpec("b", table_name="emb")]
        else:
            specs = [FeatureSpec("ids", table_name="emb")]
        iterator, batch = batched_iterator(data, BATCH, specs)
        table = create_table(tf.int64, DIM, "emb", tf.compat.v1.random_uniform_initializer(-1, 1, seed=5),
                             device_vocabulary_size=64)
        embs = [sparse_lookup(table, spec, BATCH * FIELDS, batch=batch) for spec in specs]
        loss = model_loss(tf.concat(embs, axis=1), batch["y"])
        _, sparse = get_dense_and_sparse_variable()
        opt = make_optimizer()
        train = opt.apply_gradients(zip(tf.gradients(loss, sparse), sparse))
        start_asc_pipeline()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            initial = sess.run(table.variable)
            steps = run_all(sess, iterator, train)
            final = sess.run(table.variable)
            slot_rows = [sess.run(opt.get_slot(table.variable, n)) for n in opt.get_slot_names()]
        keys, slots = table.index.export()
        lifecycle.terminate_config_initializer()
    assert len(steps) == STEPS
    for rows in slot_rows:
        assert np.all(rows[-1] == rows[-1][0]), "the sentinel's optimizer state never moves"
    return initial, final, keys, slots


def train_reference(make_tf_optimizer, initial_rows, data):
    """Plain TensorFlow: a dense variable with one row per key, rows gathered by key position."""
    keys_sorted = np.unique(data["ids"])
    positions = np.searchsorted(keys_sorted, data["ids"]).astype(np.int32)
    with tf.Graph().as_default():
        var = tf.compat.v1.Variable(initial_rows, dtype=tf.float32, use_resource=True)
        idx = tf.compat.v1.placeholder(tf.int32, [BATCH, FIELDS])
        y = tf.compat.v1.placeholder(tf.float32, [BATCH])
        loss = model_loss(tf.gather(var, idx), y)
        grad = tf.gradients(loss, [var])[0]
        train = make_tf_optimizer().apply_gradients([(grad, var)]) if make_tf_optimizer else None
        dense_grad = tf.convert_to_tensor(grad)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step in range(STEPS):
                feed = {idx: positions[step * BATCH:(step + 1) * BATCH], y: data["y"][step * BATCH:(step + 1) * BATCH]}
                if train is not None:
                    sess.run(train, feed)
                else:
                    grad_value = sess.run(dense_grad, feed)
                    touched = np.unique(feed[idx])
                    initial_rows = _numpy_lazy_adam_step(initial_rows, grad_value, touched, step + 1)
                    sess.run(var.assign(initial_rows))
            return keys_sorted, sess.run(var)


_adam_state = {}


def _numpy_lazy_adam_step(rows, grad, touched, t, lr=0.05, b1=0.9, b2=0.999, eps=1e-8):
    """Lazy Adam as documented: only touched rows and their moments move; t is the step count."""
    m = _adam_state.setdefault("m", np.zeros_like(rows))
    v = _adam_state.setdefault("v", np.zeros_like(rows))
    m[touched] = b1 * m[touched] + (1 - b1) * grad[touched]
    v[touched] = b2 * v[touched] + (1 - b2) * grad[touched] ** 2
    rows = rows.copy()
    rows[touched] -= lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m[touched] / (np.sqrt(v[touched]) + eps)
    return rows


CASES = {
    "sgd": (lambda: gradient_descent.create_hash_optimizer(learning_rate=0.05),
            lambda: tf.compat.v1.train.GradientDescentOptimizer(0.05)),
    "adagrad": (lambda: adagrad.create_hash_optimizer(learning_rate=0.1, initial_accumulator_value=0.5),
                lambda: tf.compat.v1.train.AdagradOptimizer(0.1, initial_accumulator_value=0.5)),
    "ftrl": (lambda: ftrl.create_hash_optimizer(learning_rate=0.1, l1_regularization_strength=0.001,
                                                l2_regularization_strength=0.01),
             lambda: tf.compat.v1.train.FtrlOptimizer(0.1, l1_regularization_strength=0.001,
                                                      l2_regularization_strength=0.01)),
    # A learning-rate power other than -0.5 takes the kernel's general branch.
    "ftrl_power": (lambda: ftrl.create_hash_optimizer(learning_rate=0.1, learning_rate_power=-0.7,
                                                      l1_regularization_strength=0.001),
                   lambda: tf.compat.v1.train.FtrlOptimizer(0.1, learning_rate_power=-0.7,
                                                            l1_regularization_strength=0.001)),
    "lazy_adam": (lambda: lazy_adam.create_hash_optimizer(learning_rate=0.05), None),
}


@pytest.mark.parametrize("mode", ["one_lookup", "two_lookups", "static"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_rows_match_plain_tensorflow(name, mode, graph):
    make_sparse, make_reference = CASES[name]
    data = make_data()
    initial, final, keys, slots = train_shardrec(make_sparse, data, mode)
    # Exactly the keys of the data were stored, nothing else.
    assert sorted(keys.tolist()) == sorted(np.unique(data["ids"]).tolist())
    by_key = dict(zip(keys.tolist(), slots.tolist()))
    ref_keys = np.unique(data["ids"])
    ref_initial = initial[[by_key[k] for k in ref_keys.tolist()]]
    _adam_state.clear()
    ref_keys, ref_final = train_reference(make_reference, ref_initial, data)
    ours = final[[by_key[k] for k in ref_keys.tolist()]]
    assert np.abs(ours - ref_initial).max() > 1e-2, "training moved the rows"
    np.testing.assert_allclose(ours, ref_final, atol=1e-5, rtol=0)
    # Rows that no key owns (and the sentinel) were never touched.
    untouched = np.setdiff1d(np.arange(final.shape[0]), slots)
    np.testing.assert_array_equal(final[untouched], initial[untouched])
    assert np.all(final[-1] == 0)


@pytest.mark.parametrize("lookups,deduped", [(1, False), (2, True)])
def test_only_a_gradient_summed_over_lookups_goes_through_tensorflow_dedup(graph, lookups, deduped):
    """One lookup's rows are distinct (the pipeline dedups them on the owner): its gradient skips
    TensorFlow's unique + segment sum; a table looked up twice gets a summed gradient that needs it."""
    lifecycle.init()
    names = ["a", "b"][:lookups]
    specs = [FeatureSpec(n, table_name="emb") for n in names]
    _, batch = batched_iterator({n: np.arange(8).reshape(4, 2) for n in names}, 2, specs)
    table = create_table(tf.int64, DIM, "emb", tf.compat.v1.zeros_initializer(), device_vocabulary_size=100)
    loss = tf.add_n([tf.reduce_sum(sparse_lookup(table, s, batch=batch)) for s in specs])
    grads = tf.gradients(loss, [table.variable])
    before = {op.name for op in graph.get_operations()}
    lazy_adam.create_hash_optimizer(0.1).apply_gradients(zip(grads, [table.variable]))
    added = [op.type for op in graph.get_operations() if op.name not in before]
    assert ("Unique" in added) == deduped, added


def test_a_lookups_rows_stay_distinct_in_a_copy_of_the_graph(graph):
    """Distinctness is said on the op that makes a lookup's rows, not remembered by tensor: a graph
    imported from this one's GraphDef (as graph modification and meta-graph exports make) still
    knows the gradient's rows are distinct, and a tensor of the same op that is not the rows does not."""
    from shardrec.rank_runtime.embedding.table import rows_are_distinct

    lifecycle.init()
    spec = FeatureSpec("a", table_name="emb")
    _, batch = batched_iterator({"a": np.arange(8).reshape(4, 2)}, 2, [spec])
    table = create_table(tf.int64, DIM, "emb", tf.compat.v1.zeros_initializer(), device_vocabulary_size=100)
    [grad] = tf.gradients(tf.reduce_sum(sparse_lookup(table, spec, batch=batch)), [table.variable])
    rows = grad.indices
    assert rows_are_distinct(rows) and not rows_are_distinct(batch["a"])
    copy = tf.Graph()
    with copy.as_default():
        tf.import_graph_def(graph.as_graph_def(), name="")
    assert rows_are_distinct(copy.get_tensor_by_name(rows.name))
    assert not rows_are_distinct(copy.get_tensor_by_name(batch["a"].name))


def test_a_missing_or_foreign_op_library_says_to_run_the_set_up(tmp_path, graph):
    from shardrec.rank_runtime.embedding import native_ops

    garbage = tmp_path / "tf_ops.so"
    garbage.write_bytes(b"not a shared library")
    with pytest.raises(RuntimeError, match=r"cannot be loaded into TensorFlow 2\.\d+\.\d+ .*: run the set-up again "
                                           r"\(`bash scripts/bootstrap.sh`"):
        native_ops.load(str(garbage))
    # A real shared library without shardrec's kernels (the pybind11 core).
    from shardrec.native import core

    with pytest.raises(RuntimeError, match=r"is not shardrec's op library for this version \(no "
                                           r"shardrec_sparse_apply_sgd"):
        native_ops.load(core.__file__)


def test_a_fused_update_leaves_an_earlier_read_of_the_table_as_it_was(graph):
    """Copy on write, as TensorFlow's own sparse kernels: a value read before the update (in the
    same run) keeps the old rows, the variable gets the new ones."""
    from shardrec.rank_runtime.embedding import native_ops

    w0 = np.arange(12, dtype=np.float32).reshape(4, 3)
    var = tf.compat.v1.get_variable("w", initializer=w0, use_resource=True)
    read = var.read_value()
    with tf.control_dependencies([read]):
        update = native_ops.load().shardrec_sparse_apply_sgd(var.handle, tf.constant([2, 0]),
                                                             np.ones((2, 3), np.float32), 0.5, -1)
    outside = native_ops.load().shardrec_sparse_apply_sgd(var.handle, tf.constant([1, 4]), np.ones((2, 3), np.float32),
                                                          0.5, -1)
    with tf.compat.v1.Session() as sess:
        sess.run(var.initializer)
        before, _ = sess.run([read, update])
        after = sess.run(var)
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"row index 4 at 1 is outside the table's 4 rows"):
            sess.run(outside)
        assert np.array_equal(sess.run(var), after), "a refused update changes nothing"
    np.testing.assert_array_equal(before, w0)
    np.testing.assert_array_equal(after, w0 - 0.5 * np.array([[1], [0], [1], [0]], np.float32))
