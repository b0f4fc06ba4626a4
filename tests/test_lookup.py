"""sparse_lookup in FeatureSpec mode: which row each id reads, shapes, eval, static shapes.

The oracle: a fresh table hands out rows in the order ids are first seen (features in spec order
within a batch), and the slot_row_initializer makes row s read s, so every expected output is
computed in numpy from the raw ids alone.
"""
import numpy as np
import pytest
import tensorflow as tf

from pipeline_helpers import FeatureSpec, batched_iterator, first_seen_rank, run_all, slot_row_initializer
from shardrec.rank_runtime.process import lifecycle
from shardrec.rank_runtime import create_table, sparse_lookup, start_asc_pipeline


def _expected(ids, rank_of):
    return np.vectorize(rank_of.get)(ids).astype(np.float32)


@pytest.mark.parametrize("key_dtype", [tf.int64, tf.int32])
def test_rows_follow_first_seen_order_across_tables_and_features(graph, key_dtype):
    lifecycle.init()
    rng = np.random.default_rng(0)
    np_dtype = key_dtype.as_numpy_dtype
    hi = 2**31 - 1 if key_dtype == tf.int32 else 2**62
    pool = rng.integers(-hi, hi, size=50).astype(np_dtype)
    user = pool[rng.integers(0, 50, size=(40, 3))]
    item = pool[rng.integers(0, 50, size=40)]
    other = pool[rng.integers(0, 20, size=(40, 2))]
    specs = [FeatureSpec("user", table_name="shared"), FeatureSpec("item", table_name="shared"),
             FeatureSpec("other", table_name="second")]
    iterator, batch = batched_iterator({"user": user, "item": item, "other": other}, 8, specs)
    shared = create_table(key_dtype, 3, "shared", slot_row_initializer, device_vocabulary_size=200)
    second = create_table(key_dtype, tf.TensorShape([2]), "second", slot_row_initializer, device_vocabulary_size=200)
    out_user = sparse_lookup(shared, specs[0], batch=batch)
    out_item = sparse_lookup(shared, specs[1], batch=batch)
    out_other = sparse_lookup(second, specs[2], batch=batch)
    assert out_user.shape.as_list() == [8, 3, 3] and out_item.shape.as_list() == [8, 3]
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        results = run_all(sess, iterator, [out_user, out_item, out_other])
    # Within a batch the shared table sees its features in name order: "item" then "user".
    stream = np.concatenate([np.concatenate([item[i:i + 8], user[i:i + 8].ravel()]) for i in range(0, 40, 8)])
    rank_shared = first_seen_rank(stream)
    rank_second = first_seen_rank(other.ravel())
    got_user = np.concatenate([r[0] for r in results])
    got_item = np.concatenate([r[1] for r in results])
    got_other = np.concatenate([r[2] for r in results])
    np.testing.assert_array_equal(got_user, np.repeat(_expected(user, rank_shared)[..., None], 3, -1))
    np.testing.assert_array_equal(got_item, np.repeat(_expected(item, rank_shared)[..., None], 3, -1))
    np.testing.assert_array_equal(got_other, np.repeat(_expected(other, rank_second)[..., None], 2, -1))
    assert shared.size() == len(rank_shared) and second.size() == len(rank_second)
    counters = shared.counters().as_dict()
    assert counters["size"] == len(rank_shared) and counters["keys_received"] == counters["keys_sent"] > 0
    assert counters["index_bytes"] >= 12 * len(rank_shared)
    assert shared.capacity() == 200
    keys, _ = shared.index.export()
    assert sorted(keys.tolist()) == sorted(rank_shared)


def test_eval_reads_known_rows_zeros_for_unknown_and_never_grows(graph):
    lifecycle.init()
    train_ids = np.array([[1, 2], [3, -4]], np.int64)
    eval_ids = np.array([[3, 77], [-4, 1], [88, 88], [2, 99]], np.int64)
    train_spec, eval_spec = FeatureSpec("ids", table_name="t"), FeatureSpec("ids", table_name="t")
    train_it, train_batch = batched_iterator({"ids": train_ids}, 2, [train_spec], is_training=True)
    eval_it, eval_batch = batched_iterator({"ids": eval_ids}, 2, [eval_spec], is_training=False)
    table = create_table(tf.int64, 2, "t", slot_row_initializer, device_vocabulary_size=10, init_param=2.0)
    train_out = sparse_lookup(table, train_spec, batch=train_batch)
    eval_out = sparse_lookup(table, eval_spec, batch=eval_batch, is_train=False)
    eval_default = sparse_lookup(table, eval_spec, batch=eval_batch, is_train=False, serving_default_value=-5.0)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        run_all(sess, train_it, train_out)
        got = np.concatenate([r[0] for r in run_all(sess, eval_it, [eval_out, eval_default])])
        got_default = np.concatenate([r[1] for r in run_all(sess, eval_it, [eval_out, eval_default])])
    # init_param=2 scales the initial rows: key k reads 2 * (first-seen rank of k).
    expected = np.array([[4, 0], [6, 0], [0, 0], [2, 0]], np.float32)
    np.testing.assert_array_equal(got[..., 0], expected)
    np.testing.assert_array_equal(got_default[..., 0], np.where(np.isin(eval_ids, [77, 88, 99]), -5, expected))
    assert table.size() == 4
    assert table.index.counters().missed > 0


def _static_run(send_count, ids):
    lifecycle.init(use_dynamic=False)
    spec = FeatureSpec("ids", table_name="t")
    iterator, batch = batched_iterator({"ids": ids}, 4, [spec])
    table = create_table(tf.int64, 2, "t", slot_row_initializer, device_vocabulary_size=100)
    out = sparse_lookup(table, spec, send_count, batch=batch)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        return np.concatenate(run_all(sess, iterator, out))


def test_static_shapes_give_the_same_rows_as_dynamic(graph):
    ids = np.random.default_rng(2).integers(0, 10, size=(16, 3))
    got = _static_run(12, ids)
    np.testing.assert_array_equal(got[..., 0], _expected(ids, first_seen_rank(ids.ravel())))


def test_static_shape_overflow_names_the_table_and_send_count(graph):
    ids = np.arange(48).reshape(16, 3)
    with pytest.raises(tf.errors.OpError, match=r"table 't'.*12 unique keys.*send_count=5"):
        _static_run(5, ids)


def _run_one_feature(ids, batch_size, capacity, start_pipeline=True):
    lifecycle.init()
    spec = FeatureSpec("ids", table_name="tiny")
    iterator, batch = batched_iterator({"ids": ids}, batch_size, [spec])
    table = create_table(tf.int64, 2, "tiny", slot_row_initializer, device_vocabulary_size=capacity)
    out = sparse_lookup(table, spec, batch=batch)
    if start_pipeline:
        start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        return run_all(sess, iterator, out)


def test_full_table_error_reaches_the_session(graph):
    with pytest.raises(tf.errors.OpError, match=r"table 'tiny' is full on rank 0 \(8 rows per rank.*raise the table's device_vocabulary_size"):
        _run_one_feature(np.arange(20).reshape(10, 2), 5, 8)


def test_pipeline_must_be_started_before_running(graph):
    with pytest.raises(tf.errors.OpError, match="start_asc_pipeline"):
        _run_one_feature(np.arange(4).reshape(2, 2), 2, 8, start_pipeline=False)


def test_is_grad_false_stops_gradients(graph):
    lifecycle.init()
    spec = FeatureSpec("ids", table_name="t")
    _, batch = batched_iterator({"ids": np.arange(4).reshape(2, 2)}, 2, [spec])
    table = create_table(tf.int64, 2, "t", slot_row_initializer, device_vocabulary_size=8)
    out = sparse_lookup(table, spec, batch=batch, is_grad=False)
    assert tf.gradients(tf.reduce_sum(out), [table.variable]) == [None]
