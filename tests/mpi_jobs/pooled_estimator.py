"""Estimator mode with a variable-length feature: a ragged_batch input_fn, a pooled lookup
(combiner 'mean', per-tag weights) by graph modification, train -> evaluate -> predict; then rank 0
exports a SavedModel (stock ops, a SparseTensor receiver) and serves the same examples from it.

    mpiexec -np N python pooled_estimator.py MODEL_DIR EXPORT_DIR OUT_JSON_PREFIX
"""
import json
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from mx_rec.core.embedding import create_table, sparse_lookup
from mx_rec.estimator import NPUEstimator
from mx_rec.graph.modifier import GraphModifierHook
from mx_rec.optimizers import lazy_adam
from mx_rec.util.initialize import get_rank_id, init, terminate_config_initializer

DIM, BATCH, TRAIN_STEPS, EVAL_EXAMPLES, MAX_TAGS = 8, 32, 30, 128, 6


def data(examples, seed):
    """Per example 0..MAX_TAGS tags (ids) with weights, a dense input and a label that depends on both."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, MAX_TAGS + 1, size=examples)
    tags = rng.zipf(1.4, size=lengths.sum()).astype(np.int64) % 300
    weights = rng.uniform(0.5, 2.0, size=lengths.sum()).astype(np.float32)
    x = rng.normal(size=(examples, 2)).astype(np.float32)
    splits = np.concatenate([[0], np.cumsum(lengths)])
    score = np.array([np.sin(tags[a:b]).sum() for a, b in zip(splits[:-1], splits[1:])]) + x[:, 0]
    return tags, weights, splits, x, (score > 0).astype(np.float32)


def input_fn(mode, rank):
    def fn():
        tags, weights, splits, x, labels = data(TRAIN_STEPS * BATCH if mode == "train" else EVAL_EXAMPLES, rank + 7 * (
            mode != "train"))
        features = {"tags": tf.RaggedTensor.from_row_splits(tags, splits),
                    "tag_w": tf.RaggedTensor.from_row_splits(weights, splits), "x": x}
        if mode == "predict":
            return tf.data.Dataset.from_tensor_slices(features).ragged_batch(BATCH, drop_remainder=True)
        return tf.data.Dataset.from_tensor_slices((features, labels)).ragged_batch(BATCH, drop_remainder=True)
    return fn


def model_fn(features, labels, mode):
    table = create_table(tf.int64, DIM, "tags", tf.compat.v1.truncated_normal_initializer(stddev=0.1, seed=3),
                         device_vocabulary_size=2000)
    emb = sparse_lookup(table, features["tags"], is_train=mode == tf.estimator.ModeKeys.TRAIN, modify_graph=True,
                        combiner="mean", weights=features["tag_w"], name="tags_lookup")
    with tf.compat.v1.variable_scope("tower", reuse=tf.compat.v1.AUTO_REUSE):
        logit = tf.squeeze(tf.compat.v1.layers.dense(
            tf.concat([emb, features["x"]], 1), 1, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=5)),
            1)
    prob = tf.sigmoid(logit)
    if mode == tf.estimator.ModeKeys.PREDICT:
        return tf.estimator.EstimatorSpec(mode, predictions={"prob": prob})
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logit))
    if mode == tf.estimator.ModeKeys.EVAL:
        return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={"auc": tf.compat.v1.metrics.auc(labels, prob)})
    step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.group(
        hvd.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(0.02)).minimize(
            loss, var_list=tf.compat.v1.trainable_variables(), global_step=step),
        lazy_adam.create_hash_optimizer(0.05).apply_gradients([(tf.gradients(loss, table.variable)[0], table.variable)]))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def serving_receiver():
    features = {"tags": tf.compat.v1.sparse_placeholder(tf.int64, [None, None], name="tags"),
                "tag_w": tf.compat.v1.sparse_placeholder(tf.float32, [None, None], name="tag_w"),
                "x": tf.compat.v1.placeholder(tf.float32, [None, 2], name="x")}
    return tf.estimator.export.ServingInputReceiver(features, features)


def serve(export_dir, rank):
    """The SavedModel's predictions of the predict examples, fed as SparseTensors."""
    tags, weights, splits, x, _ = data(EVAL_EXAMPLES, rank + 7)
    lengths = np.diff(splits)
    example = np.repeat(np.arange(EVAL_EXAMPLES), lengths)
    index = np.stack([example, np.arange(len(tags)) - splits[example]], 1)
    shape = [EVAL_EXAMPLES, MAX_TAGS]
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        meta = tf.compat.v1.saved_model.loader.load(sess, ["serve"], export_dir)
        signature = meta.signature_def["serving_default"]
        feed = {signature.inputs["x"].name: x}
        for name, values in (("tags", tags), ("tag_w", weights)):
            coo = signature.inputs[name].coo_sparse
            feed.update({coo.indices_tensor_name: index, coo.values_tensor_name: values,
                         coo.dense_shape_tensor_name: shape})
        return sess.run(signature.outputs["prob"].name, feed)


def main(model_dir, export_dir, out_prefix):
    tf.compat.v1.disable_eager_execution()
    init()
    rank = get_rank_id()
    est = NPUEstimator(model_fn, model_dir=model_dir, config=tf.estimator.RunConfig(tf_random_seed=1))
    est.train(input_fn("train", rank), hooks=[GraphModifierHook()], max_steps=TRAIN_STEPS)
    metrics = est.evaluate(input_fn("eval", rank), hooks=[GraphModifierHook()])
    preds = [float(p["prob"]) for p in est.predict(input_fn("predict", rank), hooks=[GraphModifierHook()])]
    exported = est.export_saved_model(export_dir, serving_receiver)
    served = serve(exported.decode() if isinstance(exported, bytes) else exported, rank).tolist() if exported else None
    with open(f"{out_prefix}-rank{rank}.json", "w") as f:
        json.dump({"metrics": {k: float(v) for k, v in metrics.items()}, "pred_probs": preds, "served": served}, f)
    terminate_config_initializer()


if __name__ == "__main__":
    main(*sys.argv[1:4])
