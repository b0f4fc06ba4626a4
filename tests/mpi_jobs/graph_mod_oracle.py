"""The same deterministic model trained in FeatureSpec mode and in graph-modification mode, one
after the other in one process (each in a graph of its own). The ids reach the lookups through a
transform (cast, hashing, slicing); in FeatureSpec mode the dataset computes them, in
graph-modification mode the graph does and shardrec moves the transform into the dataset.

Writes per mode and rank: the loss of every step, eval predictions, and every table's keys with
their rows.

    mpiexec -np N python graph_mod_oracle.py OUT_DIR [one_shot]
"""
import os
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from mx_rec.core.asc.feature_spec import FeatureSpec
from mx_rec.core.asc.helper import get_asc_insert_func
from mx_rec.core.asc.manager import start_asc_pipeline
from mx_rec.core.embedding import create_table, sparse_lookup
from mx_rec.graph.modifier import modify_graph_and_start_emb_cache
from mx_rec.optimizers import lazy_adam
from mx_rec.util.initialize import get_initializer, get_rank_id, get_rank_size, init, terminate_config_initializer
from mx_rec.util.variable import get_dense_and_sparse_variable

GLOBAL_BATCH, STEPS, EVAL_STEPS, FIELDS, DIM, DENSE = 16, 30, 4, 4, 4, 3


def global_data(steps, seed):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 60, size=(steps * GLOBAL_BATCH, FIELDS)).astype(np.int32)
    x = rng.normal(size=(steps * GLOBAL_BATCH, DENSE)).astype(np.float32)
    y = rng.normal(size=steps * GLOBAL_BATCH).astype(np.float32)
    return {"raw": raw, "x": x, "y": y}


def my_slice(data, rank, size, steps):
    local = GLOBAL_BATCH // size
    rows = np.concatenate([np.arange(s * GLOBAL_BATCH + rank * local, s * GLOBAL_BATCH + (rank + 1) * local)
                           for s in range(steps)])
    return {k: v[rows] for k, v in data.items()}, local


def deep_ids(raw):
    # int32 -> int64, hashed into a 2^40 range: what a user's graph might do before a lookup.
    return tf.math.floormod(tf.cast(raw, tf.int64) * 1_000_003 + 17, 2**40)


def wide_ids(raw):
    return tf.reshape(tf.cast(raw[:, :2], tf.int64), [-1, 2])


def build_model(batch, deep, wide, is_train, modify):
    if modify:
        e1 = sparse_lookup(deep, deep_ids(batch["raw"]), is_train=is_train, modify_graph=True, batch=batch,
                           name=f"deep_{is_train}")
        e2 = sparse_lookup(deep, deep_ids(batch["raw"][:, :1]), is_train=is_train, modify_graph=True, batch=batch,
                           name=f"deep_first_{is_train}")
        e3 = sparse_lookup(wide, wide_ids(batch["raw"]), is_train=is_train, modify_graph=True, batch=batch,
                           name=f"wide_{is_train}")
    else:
        specs = feature_specs()
        e1, e2, e3 = (sparse_lookup(t, s, is_train=is_train, batch=batch, name=f"{s.name}_{is_train}")
                      for t, s in zip((deep, deep, wide), specs))
    with tf.compat.v1.variable_scope("dense", reuse=tf.compat.v1.AUTO_REUSE):
        w = tf.compat.v1.get_variable("w", [(FIELDS + 1) * DIM + DENSE, 1],
                                      initializer=tf.compat.v1.glorot_uniform_initializer(seed=7))
    feats = tf.concat([tf.reshape(e1, [-1, FIELDS * DIM]), tf.reshape(e2, [-1, DIM]), batch["x"]], 1)
    pred = tf.squeeze(tf.matmul(feats, w), 1) + tf.reduce_sum(e3, axis=[1, 2])
    return pred, tf.reduce_mean(tf.square(pred - batch["y"]))


def feature_specs():
    return [FeatureSpec("deep", table_name="deep"), FeatureSpec("deep_first", table_name="deep"),
            FeatureSpec("wide", table_name="wide")]


def with_ids(batch):
    batch = dict(batch)
    batch["deep"] = deep_ids(batch["raw"])
    batch["deep_first"] = deep_ids(batch["raw"][:, :1])
    batch["wide"] = wide_ids(batch["raw"])
    return batch


def make_iterator(data, local, is_train, modify, one_shot):
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(local, drop_remainder=True)
    if not modify:
        dataset = dataset.map(with_ids).map(get_asc_insert_func(feature_specs(), is_training=is_train))
    if one_shot:
        return None, tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    return iterator, iterator.get_next()


def run(modify, one_shot, out_dir):
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(1)
        rank, size = get_rank_id(), get_rank_size()
        train_data, local = my_slice(global_data(STEPS, 42), rank, size, STEPS)
        eval_data, _ = my_slice(global_data(EVAL_STEPS, 43), rank, size, EVAL_STEPS)
        train_it, train_batch = make_iterator(train_data, local, True, modify, one_shot)
        eval_it, eval_batch = make_iterator(eval_data, local, False, modify, one_shot)
        deep = create_table(tf.int64, DIM, "deep", tf.compat.v1.constant_initializer(0.05), device_vocabulary_size=400,
                            all2all_gradients_op="sum_gradients_and_div_by_ranksize")
        wide = create_table(tf.int64, 1, "wide", tf.compat.v1.zeros_initializer(), device_vocabulary_size=200,
                            all2all_gradients_op="sum_gradients_and_div_by_ranksize")
        _, loss = build_model(train_batch, deep, wide, True, modify)
        eval_pred, _ = build_model(eval_batch, deep, wide, False, modify)
        dense, sparse = get_dense_and_sparse_variable()
        train_op = tf.group(hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05)).minimize(
                                loss, var_list=dense),
                            lazy_adam.create_hash_optimizer(0.02).apply_gradients(zip(tf.gradients(loss, sparse), sparse)))
        if modify:
            modify_graph_and_start_emb_cache(dump_graph=rank == 0 and not one_shot)
        else:
            start_asc_pipeline()
        losses, preds = [], []
        with tf.compat.v1.Session() as sess:
            if not one_shot:
                sess.run(get_initializer(True) if modify else train_it.initializer)
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(hvd.broadcast_variables(dense, root_rank=0))
            while True:
                try:
                    losses.append(sess.run([train_op, loss])[1])
                except tf.errors.OutOfRangeError:
                    break
            if not one_shot:
                sess.run(get_initializer(False) if modify else eval_it.initializer)
            while True:
                try:
                    preds.append(sess.run(eval_pred))
                except tf.errors.OutOfRangeError:
                    break
            tables = {}
            for table in (deep, wide):
                keys, slots = table.index.export()
                tables[table.table_name] = (keys, sess.run(table.variable)[slots])
    tag = ("modify" if modify else "spec") + ("-oneshot" if one_shot else "")
    np.savez(os.path.join(out_dir, f"{tag}-rank{rank}-of{size}.npz"), losses=np.array(losses),
             preds=np.concatenate(preds), deep_keys=tables["deep"][0], deep_rows=tables["deep"][1],
             wide_keys=tables["wide"][0], wide_rows=tables["wide"][1])


if __name__ == "__main__":
    tf.compat.v1.disable_eager_execution()
    init()
    one_shot = len(sys.argv) > 2 and sys.argv[2] == "one_shot"
    run(False, one_shot, sys.argv[1])
    run(True, one_shot, sys.argv[1])
    terminate_config_initializer()
