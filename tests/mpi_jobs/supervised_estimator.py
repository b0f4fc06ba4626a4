"""An Estimator job for the supervisor's tests, written as users write one: it saves into MODEL_DIR
every 5 steps, and started again the Estimator resumes there by itself; its input_fn starts at the
step of the latest checkpoint, so global batch s is the same whichever attempt runs it.

    shardrec-run -np 2 --checkpoint-dir MODEL_DIR -- python supervised_estimator.py MODEL_DIR

FAULT="<rank>:<step>:<kill|raise>" as in supervised_train.py (first attempt only).
"""
import sys

import horovod.tensorflow as hvd
import tensorflow as tf

from mx_rec.optimizers import lazy_adam
from shardrec.rank_runtime import (Estimator, FeatureSpec, create_table, get_asc_insert_func, get_rank_id,
                                   get_rank_size, init, report, sparse_lookup)
from supervised_train import DIM, FIELDS, GLOBAL_BATCH, TOTAL_STEPS, fault, global_batches

SPEC = FeatureSpec("ids", table_name="emb")


def input_fn(model_dir):
    def fn():
        latest = tf.train.latest_checkpoint(model_dir)
        start = int(latest.rsplit("-", 1)[1]) if latest else 0
        ids, y = global_batches()
        local = GLOBAL_BATCH // get_rank_size()
        mine = slice(get_rank_id() * local, (get_rank_id() + 1) * local)
        dataset = tf.data.Dataset.from_tensor_slices({"ids": ids[start:, mine], "y": y[start:, mine]})
        return dataset.map(get_asc_insert_func([SPEC], is_training=True))
    return fn


def model_fn(features, labels, mode):
    table = create_table(tf.int64, DIM, "emb", tf.compat.v1.truncated_normal_initializer(stddev=0.1, seed=1),
                         device_vocabulary_size=1000)
    emb = sparse_lookup(table, SPEC, batch=features)
    w = tf.compat.v1.get_variable("w", [FIELDS * DIM, 1], initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
    loss = tf.reduce_mean(tf.square(tf.squeeze(tf.matmul(tf.reshape(emb, [-1, FIELDS * DIM]), w), 1) - features["y"]))
    step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.group(
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05)).minimize(loss, var_list=[w],
                                                                                             global_step=step),
        lazy_adam.create_hash_optimizer(0.02).apply_gradients([(tf.gradients(loss, table.variable)[0],
                                                                table.variable)]))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)


class Progress(tf.compat.v1.train.SessionRunHook):
    """Tells the supervisor each step, and injects the test's fault."""

    def before_run(self, run_context):
        return tf.compat.v1.train.SessionRunArgs({"step": tf.compat.v1.train.get_global_step()})

    def after_run(self, run_context, run_values):
        step = int(run_values.results["step"]) + 1
        report(step=step, total_steps=TOTAL_STEPS)
        fault(get_rank_id(), step)


def main(model_dir):
    tf.compat.v1.disable_eager_execution()
    init()
    est = Estimator(model_fn, model_dir=model_dir,
                    config=tf.estimator.RunConfig(save_checkpoints_steps=5, tf_random_seed=1,
                                                  save_summary_steps=None, log_step_count_steps=None))
    est.train(input_fn(model_dir), hooks=[Progress()], max_steps=TOTAL_STEPS)
    print(f"DONE rank={get_rank_id()} checkpoint={tf.train.latest_checkpoint(model_dir)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
