"""Admission and eviction in Estimator mode: admission_train.py's stream and thresholds
(access_threshold 2, eviction_threshold 60 s), FeatureSpec lookups, GraphModifierHook and
EvictHook(evict_step_interval=8) as train hooks, checkpoints every 20 steps; trained in two
Estimator.train calls (20 steps, then on to 40 from the checkpoint).

    mpiexec -np N python admission_estimator.py MODEL_DIR
"""
import sys

import numpy as np
import tensorflow as tf

from admission_train import DIM, INIT, STEP_INTERVAL, STEPS, THRESHOLDS, stream
from mx_rec.core.asc.feature_spec import FeatureSpec
from mx_rec.core.asc.helper import get_asc_insert_func
from mx_rec.core.embedding import create_table, sparse_lookup
from mx_rec.core.feature_process import EvictHook
from mx_rec.estimator import NPUEstimator
from mx_rec.graph.modifier import GraphModifierHook
from mx_rec.optimizers.gradient_descent import create_hash_optimizer
from mx_rec.util.initialize import get_rank_id, get_rank_size, init, terminate_config_initializer


def spec():
    access, eviction = THRESHOLDS["evict_steps"]
    return FeatureSpec("ids", table_name="emb", access_threshold=access, eviction_threshold=eviction)


def input_fn(model_dir):
    """The stream from the step the model directory's checkpoint reached (a resumed call goes on)."""
    rank, size = get_rank_id(), get_rank_size()
    latest = tf.train.latest_checkpoint(model_dir)
    start = int(latest.rsplit("-", 1)[1]) if latest else 0
    ids, ts = stream()
    dataset = tf.data.Dataset.from_tensor_slices({"ids": ids[start:, rank::size], "ts": ts[start:, rank::size]})
    return dataset.map(get_asc_insert_func(tgt_key_specs=[spec(), FeatureSpec("ts", is_timestamp=True)],
                                           is_training=True))


def model_fn(features, labels, mode):
    table = create_table(key_dtype=tf.int64, dim=DIM, name="emb", emb_initializer=tf.compat.v1.constant_initializer(INIT),
                         device_vocabulary_size=4096)
    emb = sparse_lookup(table, spec(), batch=features, is_train=True)
    loss = tf.reduce_sum(emb * tf.constant(np.linspace(-1, 1, DIM), tf.float32))
    step = tf.compat.v1.train.get_or_create_global_step()
    train = tf.group(create_hash_optimizer(learning_rate=0.1).apply_gradients(
        [(tf.gradients(loss, table.variable)[0], table.variable)]), step.assign_add(1))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train)


def main(model_dir):
    tf.compat.v1.disable_eager_execution()
    init()
    est = NPUEstimator(model_fn, model_dir=model_dir, config=tf.estimator.RunConfig(save_checkpoints_steps=20))
    for max_steps in (STEPS // 2, STEPS):
        est.train(lambda: input_fn(model_dir), max_steps=max_steps,
                  hooks=[GraphModifierHook(modify_graph=False),
                         EvictHook(evict_step_interval=STEP_INTERVAL, evict_time_interval=None)])
    terminate_config_initializer()


if __name__ == "__main__":
    main(sys.argv[1])
