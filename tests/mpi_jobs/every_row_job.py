"""Every step adds exactly 1 to every row of table "emb" (dim 8, --keys keys, each looked up once a
step; SGD of learning rate 1 on -sum(rows)) and to the dense weight "w", then saves a delta of that
step (a full save first): the deltas that tests/test_live_serving.py serves while requests run,
each changing every row and the dense part.

    mpiexec -np 1 python every_row_job.py MODEL_DIR --steps 30 --keys 2000 [--pause S] [--die-in-save STEP]

--pause S: seconds between steps (the server applies each delta while requests go on). Restores
MODEL_DIR's latest checkpoint when there is one and goes on from its step. --die-in-save STEP: the
process SIGKILLs itself inside the save of STEP, its arrays written and its manifest not.
"""
import argparse
import os
import time

import numpy as np
import tensorflow as tf

from mx_rec.optimizers import gradient_descent
from shardrec.rank_runtime import (FeatureSpec, Saver, create_table, get_asc_insert_func,
                                   get_dense_and_sparse_variable, init, sparse_lookup, start_asc_pipeline)

DIM = 8


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--keys", type=int, default=2000)
    p.add_argument("--pause", type=float, default=0.0)
    p.add_argument("--die-in-save", type=int)
    args = p.parse_args()
    if args.die_in_save is not None:
        from stream_job import die_in_save

        die_in_save(f"model-{args.die_in_save}")
    tf.compat.v1.disable_eager_execution()
    init(is_incremental_checkpoint=True, save_checkpoint_due_time=10**6, save_delta_checkpoints_secs=1)
    keys = np.arange(args.keys, dtype=np.int64) * 7919 + 11
    spec = FeatureSpec("ids", table_name="emb")
    dataset = tf.data.Dataset.from_tensors({"ids": keys}).repeat()
    batch = tf.compat.v1.data.make_one_shot_iterator(
        dataset.map(get_asc_insert_func([spec], is_training=True))).get_next()
    table = create_table(tf.int64, DIM, "emb", tf.compat.v1.random_uniform_initializer(-1, 1, seed=3),
                         device_vocabulary_size=2 * args.keys)
    emb = sparse_lookup(table, spec, batch=batch)
    w = tf.compat.v1.get_variable("w", [DIM], initializer=tf.compat.v1.zeros_initializer())
    loss = -tf.reduce_sum(emb) - tf.reduce_sum(w)
    _, sparse = get_dense_and_sparse_variable()
    step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.group(tf.compat.v1.train.GradientDescentOptimizer(1.0).minimize(loss, var_list=[w],
                                                                                 global_step=step),
                        gradient_descent.create_hash_optimizer(1.0).apply_gradients(
                            zip(tf.gradients(loss, sparse), sparse)))
    saver = Saver(max_to_keep=10**6)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        latest = tf.train.latest_checkpoint(args.model)
        if latest:
            saver.restore(sess, latest)
        for at in range(int(sess.run(step)) + 1, args.steps + 1):
            sess.run(train_op)
            saver.save(sess, os.path.join(args.model, "model"), global_step=at)
            time.sleep(args.pause)
    print(f"SAVED {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
