"""Multi-path warm start (seed 004, example 2): three checkpoints, each variable and table must
come from the last path whose selection names it."""
import numpy as np
import pytest
import tensorflow as tf

from shardrec.rank_runtime.process import lifecycle
from shardrec.rank_runtime import create_table, init
from shardrec.rank_runtime.checkpoint.warm_start import warm_start

TABLES = ("user_table", "item_table")


def _graph(value):
    """Two tables and two dense variables, every value `value`."""
    init_ = tf.compat.v1.constant_initializer(float(value))
    tables = {name: create_table(tf.int64, 4, name, init_, device_vocabulary_size=100) for name in TABLES}
    w = tf.compat.v1.get_variable("mlp_layer_w", [4, 2], initializer=init_)
    b = tf.compat.v1.get_variable("mlp_layer_b", [2], initializer=init_)
    return tables, w, b


def _keys(i):
    return np.arange(5, dtype=np.int64) + 10 * i


def _rows(keys, i):
    """Checkpoint i's row of each key: distinct per key and per checkpoint, so a permutation of
    rows, or rows from the wrong checkpoint, cannot pass."""
    return (keys[:, None] * 1.0 + 100.0 * i + np.arange(4) * 0.25).astype(np.float32)


def _assert_rows(keys, rows, i):
    assert sorted(keys.tolist()) == _keys(i).tolist()
    np.testing.assert_array_equal(rows, _rows(keys, i))


@pytest.fixture
def three_checkpoints(tmp_path):
    """ws{i}/model-0 holds value i in its dense variables; its tables hold keys 10*i .. 10*i+4 with
    the rows _rows(keys, i)."""
    paths = []
    for i in (1, 2, 3):
        with tf.Graph().as_default():
            init()
            tables, _, _ = _graph(i)
            saver = tf.compat.v1.train.Saver()
            # Keys enter in another order than they sort, so rows do not follow key order.
            order = _keys(i)[[3, 0, 4, 1, 2]]
            writes = [tf.compat.v1.scatter_update(t.variable, np.arange(5), _rows(order, i)) for t in tables.values()]
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                for table in tables.values():
                    np.testing.assert_array_equal(table.index.lookup(order, allocate=True), np.arange(5))
                sess.run(writes)
                paths.append(saver.save(sess, str(tmp_path / f"ws{i}" / "model"), global_step=0))
            lifecycle.terminate_config_initializer()
    return paths


def _settings(paths):
    return tf.estimator.WarmStartSettings(ckpt_to_initialize_from=paths,
                                          vars_to_warm_start=[".*", ["user_table", "item_table"], "mlp_layer_w"],
                                          var_name_to_vocab_info=None, var_name_to_prev_var_name=[{}, {}, {}])


def _table_rows(sess, table):
    keys, rows_at = table.index.export()
    return keys, sess.run(table.variable)[rows_at]


def test_session_mode_takes_each_variable_from_the_last_path_that_selects_it(three_checkpoints, runtime):
    tables, w, b = _graph(0)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        warm_start(sess, _settings(three_checkpoints))
        np.testing.assert_array_equal(sess.run(w), np.full([4, 2], 3.0))   # entry 3
        np.testing.assert_array_equal(sess.run(b), np.full([2], 1.0))      # entry 1 only
        for table in tables.values():                                      # entry 2 overrides entry 1
            _assert_rows(*_table_rows(sess, table), 2)


def test_single_path_form_and_a_table_by_name(three_checkpoints, runtime):
    tables, w, _ = _graph(0)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        warm_start(sess, tf.estimator.WarmStartSettings(ckpt_to_initialize_from=three_checkpoints[2],
                                                        vars_to_warm_start="user_table"))
        _assert_rows(*_table_rows(sess, tables["user_table"]), 3)
        assert tables["item_table"].size() == 0, "a table no entry selects stays as it was"
        np.testing.assert_array_equal(sess.run(w), np.zeros([4, 2]))


def test_estimator_warm_start_from(three_checkpoints, runtime, tmp_path):
    from mx_rec.optimizers import gradient_descent
    from shardrec.rank_runtime import Estimator, sparse_lookup

    def model_fn(features, labels, mode):
        tables, w, b = _graph(0)
        emb = sparse_lookup(tables["user_table"], features["ids"], modify_graph=True)
        loss = tf.reduce_sum(tf.matmul(tf.reshape(emb, [-1, 4]), w) + b) * labels[0]
        step = tf.compat.v1.train.get_or_create_global_step()
        table_var = tables["user_table"].variable
        train_op = tf.group(step.assign_add(1),
                            gradient_descent.create_hash_optimizer(0.0).apply_gradients(
                                [(tf.gradients(loss, table_var)[0], table_var)]))
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    def input_fn():
        return tf.data.Dataset.from_tensors(({"ids": tf.constant([[20, 21]], tf.int64)}, tf.constant([1.0])))

    est = Estimator(model_fn, model_dir=str(tmp_path / "est"), warm_start_from=_settings(three_checkpoints),
                    config=tf.estimator.RunConfig(save_checkpoints_steps=1))
    est.train(input_fn, max_steps=1)
    reader = tf.train.load_checkpoint(str(tmp_path / "est"))
    np.testing.assert_array_equal(reader.get_tensor("mlp_layer_w"), np.full([4, 2], 3.0))
    np.testing.assert_array_equal(reader.get_tensor("mlp_layer_b"), np.full([2], 1.0))
    keys = np.load(tmp_path / "est" / "sparse-model.ckpt-1" / "rank-0-of-1" / "user_table" / "keys.npy")
    values = np.load(tmp_path / "est" / "sparse-model.ckpt-1" / "rank-0-of-1" / "user_table" / "values.npy")
    _assert_rows(keys, values, 2)


def test_renaming_a_table_and_mismatched_lists_are_refused(three_checkpoints, runtime):
    _graph(0)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(ValueError, match=r"renames table\(s\) \['user_table'\]; renaming a table is not supported"):
            warm_start(sess, tf.estimator.WarmStartSettings(three_checkpoints[0],
                                                            var_name_to_prev_var_name={"user_table": "old_table"}))
        with pytest.raises(ValueError, match="3 path\\(s\\) but vars_to_warm_start has 2"):
            warm_start(sess, tf.estimator.WarmStartSettings(three_checkpoints, vars_to_warm_start=[".*", ".*"]))
