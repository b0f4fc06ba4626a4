"""Wide&Deep in Estimator mode (seed 003's NPUEstimator scenario): tf.estimator.train_and_evaluate
on every rank, tables created inside model_fn, ids looked up with modify_graph=True and the key
pipeline inserted by GraphModifierHook in each mode.

    mpiexec -np 2 python examples/estimator_wide_deep.py [--steps N] [--model-dir DIR]

Each rank trains and evaluates on its own shard of the data; rank 0 writes the dense checkpoint
and summaries, every rank its shard of the tables (model_dir/sparse-model.ckpt-<step>/).
"""
import argparse
import os
import sys

import horovod.tensorflow as hvd
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import criteo_synth  # noqa: E402

from mx_rec.core.embedding import create_table, sparse_lookup  # noqa: E402
from mx_rec.estimator import NPUEstimator  # noqa: E402
from mx_rec.graph.modifier import GraphModifierHook  # noqa: E402
from mx_rec.optimizers.lazy_adam import create_hash_optimizer  # noqa: E402
from mx_rec.util.initialize import get_rank_id, init, terminate_config_initializer  # noqa: E402
from mx_rec.util.variable import get_dense_and_sparse_variable  # noqa: E402

DEEP_DIM = 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=400, help="training steps")
    p.add_argument("--batch-size", type=int, default=512, help="per-rank batch size")
    p.add_argument("--eval-samples", type=int, default=20_000, help="held-out samples per rank")
    p.add_argument("--eval-every", type=int, default=200, help="steps between evaluations (and checkpoints)")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--model-dir", default="estimator-model")
    return p.parse_args(argv)


def input_fn(data, batch_size, repeat):
    def fn():
        features = {"cat": data["cat"], "dense": data["dense"]}
        dataset = tf.data.Dataset.from_tensor_slices((features, data["label"]))
        if repeat:
            dataset = dataset.repeat()
        return dataset.batch(batch_size, drop_remainder=True).prefetch(4)
    return fn


def model_fn(features, labels, mode, params):
    is_train = mode == tf.estimator.ModeKeys.TRAIN
    # Tables are created inside model_fn: the Estimator builds a new graph for every call.
    deep_table = create_table(tf.int64, DEEP_DIM, "deep_table", tf.compat.v1.truncated_normal_initializer(stddev=0.05),
                              device_vocabulary_size=params["vocab"])
    wide_table = create_table(tf.int64, 1, "wide_table", tf.compat.v1.zeros_initializer(),
                              device_vocabulary_size=params["vocab"])
    deep = sparse_lookup(deep_table, features["cat"], is_train=is_train, modify_graph=True, name="deep_lookup")
    wide = sparse_lookup(wide_table, features["cat"], is_train=is_train, modify_graph=True, name="wide_lookup")
    x = tf.concat([tf.reshape(deep, [-1, criteo_synth.NUM_CAT * DEEP_DIM]), features["dense"]], axis=1)
    for units in (256, 128):
        x = tf.compat.v1.layers.dense(x, units, tf.nn.relu)
    logit = tf.squeeze(tf.compat.v1.layers.dense(x, 1) + tf.reduce_sum(wide, axis=1), axis=1)
    prob = tf.sigmoid(logit)
    if mode == tf.estimator.ModeKeys.PREDICT:
        return tf.estimator.EstimatorSpec(mode, predictions={"prob": prob})
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logit))
    if mode == tf.estimator.ModeKeys.EVAL:
        return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={"auc": tf.compat.v1.metrics.auc(labels, prob)})
    dense, sparse = get_dense_and_sparse_variable()
    step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.group(
        hvd.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(0.001)).minimize(loss, var_list=dense, global_step=step),
        create_hash_optimizer(learning_rate=0.01).apply_gradients(zip(tf.gradients(loss, sparse), sparse)))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


def main(argv=None):
    args = parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    init(train_steps=args.steps)
    rank = get_rank_id()
    train = criteo_synth.make_dataset(args.steps * args.batch_size, seed=args.seed, sample_seed=args.seed * 31 + rank)
    held_out = criteo_synth.make_dataset(args.eval_samples, seed=args.seed, sample_seed=args.seed * 31 + 10_000 + rank)
    estimator = NPUEstimator(model_fn, model_dir=args.model_dir,
                             params={"vocab": int(criteo_synth.vocab_sizes(args.seed).sum())},
                             config=tf.estimator.RunConfig(save_checkpoints_steps=args.eval_every,
                                                           tf_random_seed=args.seed))
    train_spec = tf.estimator.TrainSpec(input_fn(train, args.batch_size, repeat=True), max_steps=args.steps,
                                        hooks=[GraphModifierHook()])
    eval_spec = tf.estimator.EvalSpec(input_fn(held_out, args.batch_size, repeat=False), steps=None,
                                      hooks=[GraphModifierHook()], throttle_secs=0, start_delay_secs=0)
    metrics, _ = tf.estimator.train_and_evaluate(estimator, train_spec, eval_spec)
    if metrics is None:
        # Seen with --eval-every equal to --steps (40 and 40): train_and_evaluate returned no
        # metrics although it evaluated; the summary then evaluates the final checkpoint itself.
        metrics = estimator.evaluate(input_fn(held_out, args.batch_size, repeat=False), hooks=[GraphModifierHook()])
    print(f"SUMMARY rank={rank} global_step={int(metrics['global_step'])} eval_auc={metrics['auc']:.4f} "
          f"eval_loss={metrics['loss']:.4f} checkpoint={tf.train.latest_checkpoint(args.model_dir)}", flush=True)
    terminate_config_initializer()
    return metrics


if __name__ == "__main__":
    main()
