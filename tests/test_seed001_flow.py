"""Seed 001's tf.Session call sequence, through the mx_rec imports, trains: the loss falls, the
Saver writes and restores, and terminate_config_initializer ends it."""
import os

import numpy as np
import tensorflow as tf

from mx_rec.core.asc.feature_spec import FeatureSpec
from mx_rec.core.asc.helper import get_asc_insert_func
from mx_rec.core.asc.manager import start_asc_pipeline
from mx_rec.core.embedding import create_table, sparse_lookup
from mx_rec.optimizers.lazy_adam import create_hash_optimizer
from mx_rec.util.initialize import get_rank_id, get_use_dynamic_expansion, init, terminate_config_initializer
from mx_rec.util.variable import get_dense_and_sparse_variable
from shardrec.rank_runtime.process import config

BATCH = 32


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    user = rng.integers(0, 300, size=(n, 2))
    item = rng.integers(-200, 0, size=(n, 3))
    # The label depends on the ids: even users and items below -100 click.
    label = ((user[:, 0] % 2 == 0) & (item[:, 0] < -100)).astype(np.float32)
    return {"user_ids": user, "item_ids": item, "label_0": label}


def get_dataset(feature_spec_list, is_training, data):
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(BATCH, drop_remainder=True)
    insert_fn = get_asc_insert_func(tgt_key_specs=feature_spec_list, is_training=is_training, dump_graph=False)
    dataset = dataset.map(insert_fn)
    dataset = dataset.prefetch(100)
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    return iterator.get_next(), iterator


def model_forward(batch, tables, feature_list, is_train):
    embedding_list = []
    for feature, hash_table in zip(feature_list, tables):
        embedding = sparse_lookup(hash_table, feature, BATCH * 3, is_train=is_train,
                                  name=hash_table.table_name + "_lookup", modify_graph=False, batch=batch)
        embedding_list.append(tf.reduce_sum(embedding, axis=1, keepdims=False))
    with tf.compat.v1.variable_scope("mlp", reuse=tf.compat.v1.AUTO_REUSE):
        w = tf.compat.v1.get_variable("w", [16, 1], initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
        logit = tf.squeeze(tf.matmul(tf.concat(embedding_list, axis=1), w), 1)
    return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=batch["label_0"], logits=logit))


def test_seed_001_session_flow(graph, tmp_path):
    init(max_steps=-1, train_steps=100, eval_steps=10, save_steps=50, use_dynamic=True, use_dynamic_expansion=False)
    specs = lambda: [FeatureSpec("user_ids", table_name="user_table"), FeatureSpec("item_ids", table_name="item_table")]
    train_batch, train_iterator = get_dataset(specs(), True, make_data(BATCH * 100, 0))
    eval_batch, eval_iterator = get_dataset(specs(), False, make_data(BATCH * 10, 1))
    dense_optimizer = tf.compat.v1.train.AdamOptimizer(learning_rate=0.01)
    assert not get_use_dynamic_expansion()
    sparse_optimizer = create_hash_optimizer(learning_rate=0.02)
    init_fn = tf.compat.v1.truncated_normal_initializer(seed=3)
    user_table = create_table(key_dtype=tf.int64, dim=tf.TensorShape([8]), name="user_table",
                              emb_initializer=init_fn, device_vocabulary_size=300 * 10, host_vocabulary_size=0)
    item_table = create_table(key_dtype=tf.int64, dim=tf.TensorShape([8]), name="item_table",
                              emb_initializer=init_fn, device_vocabulary_size=200 * 10, host_vocabulary_size=0)
    tables = [user_table, item_table]
    train_loss = model_forward(train_batch, tables, specs(), True)
    eval_loss = model_forward(eval_batch, tables, specs(), False)
    dense_variables, sparse_variables = get_dense_and_sparse_variable()
    assert [v.name for v in sparse_variables] == ["user_table:0", "item_table:0"]
    assert [v.name for v in dense_variables] == ["mlp/w:0"]
    train_ops = [dense_optimizer.minimize(train_loss, var_list=dense_variables)]
    grads = tf.gradients(train_loss, sparse_variables)
    train_ops.append(sparse_optimizer.apply_gradients(zip(grads, sparse_variables)))

    saver = tf.compat.v1.train.Saver()
    start_asc_pipeline()
    rank_id = get_rank_id()
    prefix = os.path.join(tmp_path, f"model-{rank_id}")
    losses = []
    with tf.compat.v1.Session() as sess:
        sess.run(train_iterator.initializer)
        sess.run(tf.compat.v1.global_variables_initializer())
        saver.save(sess, prefix, global_step=0)
        for i in range(1, 201):
            try:
                losses.append(sess.run([train_ops, train_loss])[1])
            except tf.errors.OutOfRangeError:
                break
        saver.save(sess, prefix, global_step=len(losses))
        sess.run(eval_iterator.initializer)
        first_eval = sess.run(eval_loss)
        def rows_by_key():
            keys, rows_at = user_table.index.export()
            return dict(zip(keys.tolist(), sess.run(user_table.variable)[rows_at]))

        trained_user = rows_by_key()
        # Restoring step 0 (saved before any key arrived) empties the table and re-initialises it.
        saver.restore(sess, f"{prefix}-0")
        assert user_table.size() == 0
        assert not np.allclose(sess.run(user_table.variable)[:len(trained_user)], np.stack(list(trained_user.values())))
        saver.restore(sess, f"{prefix}-{len(losses)}")
        restored = rows_by_key()
        assert set(restored) == set(trained_user)
        for key, row in trained_user.items():
            np.testing.assert_array_equal(restored[key], row)
    assert len(losses) == 100, "the dataset ends after 100 batches"
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10]), losses
    assert np.isfinite(first_eval)
    assert user_table.size() == len(np.unique(make_data(BATCH * 100, 0)["user_ids"]))
    terminate_config_initializer()
    assert not config.is_initialized()
