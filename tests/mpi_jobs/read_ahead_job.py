"""A job whose batches each bring 100 keys never seen before (step s: keys 100*s .. 100*s+99, table
"emb" of dim 4, random initial rows, SGD), read ahead of the step by the dataset's prefetch and the
key pipeline: after --steps steps, once the pipeline holds a later batch's keys, it saves once, a save
that holds keys of batches it has not trained, at their initial rows. tests/test_grpc_serving.py
serves that save.

    mpiexec -np 1 python read_ahead_job.py MODEL_DIR [--steps 3]
"""
import argparse
import os
import time

import numpy as np
import tensorflow as tf

from mx_rec.optimizers import gradient_descent
from shardrec.rank_runtime import (FeatureSpec, Saver, create_table, get_asc_insert_func,
                                   get_dense_and_sparse_variable, init, sparse_lookup, start_asc_pipeline)

KEYS_PER_STEP = 100


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    tf.compat.v1.disable_eager_execution()
    init()
    keys = np.arange(20 * KEYS_PER_STEP, dtype=np.int64).reshape(20, KEYS_PER_STEP)
    spec = FeatureSpec("ids", table_name="emb")
    dataset = tf.data.Dataset.from_tensor_slices({"ids": keys})
    batch = tf.compat.v1.data.make_one_shot_iterator(
        dataset.map(get_asc_insert_func([spec], is_training=True)).prefetch(4)).get_next()
    table = create_table(tf.int64, 4, "emb", tf.compat.v1.random_uniform_initializer(-1, 1, seed=5),
                         device_vocabulary_size=4096)
    emb = sparse_lookup(table, spec, batch=batch)
    w = tf.compat.v1.get_variable("w", [4], initializer=tf.compat.v1.ones_initializer())
    loss = tf.reduce_sum(tf.square(emb * w))
    _, sparse = get_dense_and_sparse_variable()
    step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.group(tf.compat.v1.assign_add(step, 1), gradient_descent.create_hash_optimizer(0.1).apply_gradients(
        zip(tf.gradients(loss, sparse), sparse)))
    saver = Saver()
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in range(args.steps):
            sess.run(train_op)
        # The save must hold keys of a batch not trained yet: wait (bounded) until the key pipeline
        # has taken in at least one batch beyond the steps run.
        deadline = time.monotonic() + 60
        while table.size() < (args.steps + 1) * KEYS_PER_STEP:
            if time.monotonic() > deadline:
                raise SystemExit(f"the key pipeline read no batch ahead in 60 s ({table.size()} keys held)")
            time.sleep(0.01)
        saver.save(sess, os.path.join(args.model, "model"), global_step=args.steps)
    print(f"SAVED after {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
