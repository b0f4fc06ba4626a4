"""Deterministic training over fixed global batches, each rank taking its slice of every global
batch. Writes, per optimizer and rank, the keys this rank holds, their rows and the dense weights.

    mpiexec -np N python oracle_train.py OUT_DIR [div|sum|div,sum] [float16|bfloat16]

A third argument holds the table's values in that 16-bit dtype, rounded to the nearest (the oracle
of test_row_dtypes.py: TensorFlow's float32 arithmetic on a 16-bit variable).

div (default): tables use all2all_gradients_op="sum_gradients_and_div_by_ranksize", each rank's
loss is the mean over its slice, Horovod averages dense gradients. sum: the default
"sum_gradients", each rank's loss is its slice's sum over the global batch size, Horovod sums
dense gradients. Either way N ranks compute the gradients of the global batch's mean loss, so
they must reproduce one rank.
"""
import os
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from mx_rec.optimizers import gradient_descent, lazy_adam
from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable,
                                   get_rank_id, get_rank_size, init, sparse_lookup, start_asc_pipeline)
from shardrec.rank_runtime.process import lifecycle

GLOBAL_BATCH, STEPS, FIELDS, DIM, DENSE = 16, 40, 3, 4, 4
OPTIMIZERS = {"sgd": lambda: gradient_descent.create_hash_optimizer(0.1),
              "lazy_adam": lambda: lazy_adam.create_hash_optimizer(0.02)}


def global_data():
    rng = np.random.default_rng(42)
    pool = np.concatenate([rng.integers(-(2**40), 2**40, size=40), np.arange(-6, 6)])
    ids = pool[np.minimum(rng.geometric(0.06, size=(STEPS * GLOBAL_BATCH, FIELDS)) - 1, len(pool) - 1)]
    x = rng.normal(size=(STEPS * GLOBAL_BATCH, DENSE)).astype(np.float32)
    y = rng.normal(size=STEPS * GLOBAL_BATCH).astype(np.float32)
    return {"ids": ids.astype(np.int64), "x": x, "y": y}


def my_slice(data, rank, size):
    local = GLOBAL_BATCH // size
    rows = np.concatenate([np.arange(s * GLOBAL_BATCH + rank * local, s * GLOBAL_BATCH + (rank + 1) * local)
                           for s in range(STEPS)])
    return {k: v[rows] for k, v in data.items()}, local


def train(opt_name, out_dir, mode, value_dtype=tf.float32):
    tf.compat.v1.reset_default_graph()
    init()
    rank, size = get_rank_id(), get_rank_size()
    data, local_batch = my_slice(global_data(), rank, size)
    spec = FeatureSpec("ids", table_name="emb")
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(local_batch, drop_remainder=True)
    dataset = dataset.map(get_asc_insert_func([spec], is_training=True))
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    batch = iterator.get_next()
    # Every row starts equal, so the oracle does not depend on which row a key lands in.
    gradients_op = "sum_gradients" if mode == "sum" else "sum_gradients_and_div_by_ranksize"
    table = create_table(tf.int64, DIM, "emb", tf.compat.v1.constant_initializer(0.1), device_vocabulary_size=256,
                         all2all_gradients_op=gradients_op, value_dtype=value_dtype,
                         stochastic_rounding=False)
    emb = sparse_lookup(table, spec, batch=batch)
    w = tf.compat.v1.get_variable("w", [FIELDS * DIM + DENSE, 1], initializer=tf.compat.v1.glorot_uniform_initializer(seed=7))
    pred = tf.squeeze(tf.matmul(tf.concat([tf.reshape(emb, [-1, FIELDS * DIM]), batch["x"]], 1), w), 1)
    if mode == "sum":
        loss = tf.reduce_sum(tf.square(pred - batch["y"])) / GLOBAL_BATCH
    else:
        loss = tf.reduce_mean(tf.square(pred - batch["y"]))
    dense, sparse = get_dense_and_sparse_variable()
    dense_opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05),
                                         op=hvd.Sum if mode == "sum" else hvd.Average)
    train_op = tf.group(dense_opt.minimize(loss, var_list=dense),
                        OPTIMIZERS[opt_name]().apply_gradients(zip(tf.gradients(loss, sparse), sparse)))
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_variables(dense, root_rank=0))
        sess.run(iterator.initializer)
        steps = 0
        while True:
            try:
                sess.run(train_op)
                steps += 1
            except tf.errors.OutOfRangeError:
                break
        rows, w_value = sess.run([table.variable, w])
        rows = rows.astype(np.float32)
    keys, slots = table.index.export()
    global_size = table.global_size()
    np.savez(os.path.join(out_dir, f"{mode}-{opt_name}-rank{rank}-of{size}.npz"), keys=keys, rows=rows[slots], w=w_value,
             steps=steps, global_size=global_size, local_size=table.size(),
             bytes_per_row=table.counters().bytes_per_row)
    lifecycle.terminate_config_initializer()


if __name__ == "__main__":
    tf.compat.v1.disable_eager_execution()
    # Both modes in one job when asked: one start of MPI, TensorFlow and Horovod for both.
    dtype = tf.as_dtype(sys.argv[3]) if len(sys.argv) > 3 else tf.float32
    for mode in (sys.argv[2] if len(sys.argv) > 2 else "div").split(","):
        for name in OPTIMIZERS:
            train(name, sys.argv[1], mode, dtype)
