"""Estimator train -> evaluate -> predict on every rank (graph-modification lookups, hooks as the
seeds add them), then a tf.Session evaluation of the same checkpoint as the oracle.

    mpiexec -np N python estimator_flow.py MODEL_DIR OUT_JSON_PREFIX

Writes OUT_JSON_PREFIX-rank<r>.json: the Estimator's eval metrics, the Session-mode AUC and
predictions of the same checkpoint, the Estimator's predictions (with the row numbers they came
with) and the table sizes. With SSD_DIR set, the table has an SSD tier there below a memory budget
of 220 rows a rank (every graph the Estimator builds makes its own). With HOLD_PREFETCH_S set, the
training data runs two batches past max_steps (as a step limit leaves it) and rank 1's input holds
the batch after the last trained one until its session close holds the channel (at most that many
seconds): its session closes before its prefetch begins that batch's key round, while rank 0's has
begun it (issue 75's race, forced).
"""
import json
import os
import sys
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from mx_rec.core.embedding import create_table, sparse_lookup
from mx_rec.estimator import NPUEstimator
from mx_rec.graph.modifier import GraphModifierHook, modify_graph_and_start_emb_cache
from mx_rec.optimizers import lazy_adam
from mx_rec.util.initialize import get_initializer, get_rank_id, get_rank_size, init, terminate_config_initializer

FIELDS, DIM, DENSE, BATCH = 5, 8, 3, 32
TRAIN_STEPS, EVAL_ROWS = 40, 8 * BATCH
HOLD_PREFETCH_S = float(os.environ.get("HOLD_PREFETCH_S", "0"))


def data(rows, seed):
    rng = np.random.default_rng(seed)
    ids = rng.zipf(1.5, size=(rows, FIELDS)).astype(np.int64) % 500 + 1000 * np.arange(FIELDS)
    x = rng.normal(size=(rows, DENSE)).astype(np.float32)
    score = np.sin(ids % 7).sum(1) * 0.6 + x[:, 0]
    label = (score + rng.normal(scale=0.5, size=rows) > 0).astype(np.float32)
    return {"ids": ids, "x": x, "row": np.arange(rows, dtype=np.int64)}, label


def _hold_after_last_step(batch_number):
    """At the batch after the last trained one: until this rank's session close has closed the
    training channel (it then waits for this thread), at most HOLD_PREFETCH_S seconds."""
    if batch_number == TRAIN_STEPS:
        from shardrec.rank_runtime.formats.channel import Channel
        from shardrec.rank_runtime.process.world import get_world

        deadline = time.monotonic() + HOLD_PREFETCH_S
        while not get_world().exchanges[Channel.TRAIN].closing and time.monotonic() < deadline:
            time.sleep(0.01)
    return batch_number


@tf.autograph.experimental.do_not_convert
def _held(batch_number, element):
    """The element, once rank 1's prefetch has waited at the batch after the last trained one."""
    with tf.control_dependencies([tf.numpy_function(_hold_after_last_step, [batch_number], tf.int64)]):
        return tf.nest.map_structure(tf.identity, element)


def input_fn(mode, rank):
    def fn():
        if mode == "train":
            features, labels = data(TRAIN_STEPS * BATCH, 10 + rank)
            dataset = tf.data.Dataset.from_tensor_slices((features, labels)).batch(BATCH, drop_remainder=True)
            if HOLD_PREFETCH_S:
                more = tf.data.Dataset.from_tensor_slices(data(2 * BATCH, 20 + rank)).batch(BATCH, drop_remainder=True)
                dataset = dataset.concatenate(more)
                if rank == 1:
                    dataset = dataset.enumerate().map(_held)
            return dataset
        features, labels = data(EVAL_ROWS, 100 + rank)
        if mode == "predict":
            return tf.data.Dataset.from_tensor_slices(features).batch(BATCH, drop_remainder=True)
        return tf.data.Dataset.from_tensor_slices((features, labels)).batch(BATCH, drop_remainder=True)
    return fn


def forward(features, is_train):
    tiers = dict(device_vocabulary_size=20_000)
    if os.environ.get("SSD_DIR"):
        tiers = dict(device_vocabulary_size=220, host_vocabulary_size=220, ssd_vocabulary_size=20_000,
                     ssd_data_path=[os.environ["SSD_DIR"]])
    table = create_table(tf.int64, DIM, "emb", tf.compat.v1.truncated_normal_initializer(stddev=0.05, seed=3), **tiers)
    # A transform between get_next() and the lookup, as users write them.
    ids = tf.reshape(features["ids"], [-1, FIELDS])
    emb = sparse_lookup(table, ids, is_train=is_train, modify_graph=True, name="emb_lookup")
    with tf.compat.v1.variable_scope("tower", reuse=tf.compat.v1.AUTO_REUSE):
        h = tf.compat.v1.layers.dense(tf.concat([tf.reshape(emb, [-1, FIELDS * DIM]), features["x"]], 1), 16,
                                      tf.nn.relu, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=4))
        logit = tf.squeeze(tf.compat.v1.layers.dense(h, 1, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=5)), 1)
    return table, logit, emb


def model_fn(features, labels, mode):
    table, logit, _ = forward(features, mode == tf.estimator.ModeKeys.TRAIN)
    prob = tf.sigmoid(logit)
    if mode == tf.estimator.ModeKeys.PREDICT:
        return tf.estimator.EstimatorSpec(mode, predictions={"prob": prob, "row": features["row"]})
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logit))
    if mode == tf.estimator.ModeKeys.EVAL:
        return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={"auc": tf.compat.v1.metrics.auc(labels, prob)})
    step = tf.compat.v1.train.get_or_create_global_step()
    dense = tf.compat.v1.trainable_variables()
    train_op = tf.group(
        hvd.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(0.01)).minimize(loss, var_list=dense, global_step=step),
        lazy_adam.create_hash_optimizer(0.02).apply_gradients([(tf.gradients(loss, table.variable)[0], table.variable)]))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def serving_receiver():
    """The raw features a served model takes: ids as int64, the dense inputs, the row number."""
    features = {"ids": tf.compat.v1.placeholder(tf.int64, [None, FIELDS], name="ids"),
                "x": tf.compat.v1.placeholder(tf.float32, [None, DENSE], name="x"),
                "row": tf.compat.v1.placeholder(tf.int64, [None], name="row")}
    return tf.estimator.export.ServingInputReceiver(features, features)


def serving_outputs(features):
    """tf.Session mode's export function: the inference graph from raw features, with the looked-up
    rows as an output too (the test compares them with the checkpoint's rows)."""
    _, logit, emb = forward(features, False)
    return {"prob": tf.sigmoid(logit), "emb": emb}


def session_evaluation(checkpoint, rank):
    """The oracle: the same eval graph in tf.Session mode, restored from the Estimator's checkpoint."""
    with tf.Graph().as_default():
        dataset = input_fn("eval", rank)()
        iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
        features, labels = iterator.get_next()
        table, logit, _ = forward(features, False)
        prob = tf.sigmoid(logit)
        auc, update = tf.compat.v1.metrics.auc(labels, prob)
        saver = tf.compat.v1.train.Saver()
        modify_graph_and_start_emb_cache()
        probs = []
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.local_variables_initializer())
            saver.restore(sess, checkpoint)
            sess.run(get_initializer(False))
            while True:
                try:
                    probs.append(sess.run([update, prob])[1])
                except tf.errors.OutOfRangeError:
                    break
            return float(sess.run(auc)), np.concatenate(probs), table.size()


def main(model_dir, out_prefix):
    tf.compat.v1.disable_eager_execution()
    init()
    rank = get_rank_id()
    est = NPUEstimator(model_fn, model_dir=model_dir,
                       config=tf.estimator.RunConfig(save_checkpoints_steps=15, tf_random_seed=1))
    est.train(input_fn("train", rank), hooks=[GraphModifierHook()], max_steps=TRAIN_STEPS)
    metrics = est.evaluate(input_fn("eval", rank), hooks=[GraphModifierHook()])
    preds = list(est.predict(input_fn("predict", rank), hooks=[GraphModifierHook()]))
    checkpoint = tf.train.latest_checkpoint(model_dir)
    auc, probs, size = session_evaluation(checkpoint, rank)
    if os.environ.get("EXPORT_DIR"):
        # On every rank, as scripts do: rank 0 exports (no other rank needed), the others get None.
        exported = est.export_saved_model(os.environ["EXPORT_DIR"], serving_receiver)
        assert (exported is None) == (rank > 0), (rank, exported)
    with open(f"{out_prefix}-rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "size": get_rank_size(), "metrics": {k: float(v) for k, v in metrics.items()},
                   "session_auc": auc, "session_probs": probs.tolist(), "checkpoint": checkpoint,
                   "pred_probs": [float(p["prob"]) for p in preds], "pred_rows": [int(p["row"]) for p in preds],
                   "restored_keys": size}, f)
    terminate_config_initializer()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
