"""Four tables, one per placement, trained over fixed global batches (each rank its slice of each),
so that any placement and rank count must reproduce plain TensorFlow on the global batches
(tests/test_sharding.py). Optionally saves at the end, or restores instead of training.

    mpiexec -np N python placement_oracle.py OUT TAG [--sharding a=row_wise,b=table_wise:1,c=replicated]
        [--plan auto|PATH] [--opt sgd[,lazy_adam]] [--modes plain[,admission,expansion,static]] [--save PREFIX]
        [--restore PATH]
        [--value-dtype bfloat16|float16] [--last-rank-sharding ...] [--groups a=g,b=g]
        [--last-rank-exchange-dtype bfloat16]

--sharding gives each table's create_table(sharding=, sharding_rank=) (default: the four placements,
the table-wise one on the last rank, the column-wise one on the last two; "d=column_wise:1-2" gives
the ranks 1 and 2); a table left out takes the plan's (--plan) placement or
row-wise; --groups gives tables a create_table(sharding_group=). Writes
OUT/TAG-OPT-MODE-rank<r>-of<N>.npz per optimizer and mode (each in turn, in one process): per table
its keys and every column of its rows, the dense weights, the steps run.
"""
import argparse
import os

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from mx_rec.optimizers import gradient_descent, lazy_adam
from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable,
                                   get_rank_id, get_rank_size, init, sparse_lookup, start_asc_pipeline,
                                   terminate_config_initializer)

GLOBAL_BATCH, STEPS, FIELDS, DIM, DENSE = 12, 30, 3, 4, 4
TABLES = ("a", "b", "c", "d")
LEARNING_RATES = {"sgd": 0.1, "lazy_adam": 0.02}


def global_data():
    rng = np.random.default_rng(21)
    out = {}
    for i, name in enumerate(TABLES):
        pool = np.concatenate([rng.integers(-(2**40), 2**40, size=30), np.arange(-5, 5) * (i + 1)])
        ids = pool[np.minimum(rng.geometric(0.08, size=(STEPS * GLOBAL_BATCH, FIELDS)) - 1, len(pool) - 1)]
        out[name] = ids.astype(np.int64)
    out["x"] = rng.normal(size=(STEPS * GLOBAL_BATCH, DENSE)).astype(np.float32)
    out["y"] = rng.normal(size=STEPS * GLOBAL_BATCH).astype(np.float32)
    return out


def my_slice(data, rank, size):
    local = GLOBAL_BATCH // size
    rows = np.concatenate([np.arange(s * GLOBAL_BATCH + rank * local, s * GLOBAL_BATCH + (rank + 1) * local)
                           for s in range(STEPS)])
    return {k: v[rows] for k, v in data.items()}, local


def shardings(text, size):
    """{table: (sharding, rank)} from "a=row_wise,b=table_wise:1,d=column_wise:0-1"."""
    if text is None:
        return {"a": ("row_wise", None), "b": ("table_wise", size - 1), "c": ("replicated", None),
                "d": ("column_wise", list(range(max(0, size - 2), size)))}
    out = {}
    for item in filter(None, text.split(",")):
        name, kind = item.split("=")
        kind, _, rank = kind.partition(":")
        first, _, last = rank.partition("-")
        out[name] = (kind, None if not rank else list(range(int(first), int(last) + 1)) if last else int(first))
    return out


def model(batch, tables, specs, embs=None, send_count=None):
    """(loss, w); `embs`: the tables' rows for the batch ([batch, FIELDS, DIM] each) when not looked up;
    send_count: static shapes' bound on the ids a rank sends one owner."""
    if embs is None:
        embs = [sparse_lookup(t, s, send_count, batch=batch) for t, s in zip(tables, specs)]
    embs = [tf.reshape(e, [-1, FIELDS * DIM]) for e in embs]
    w = tf.compat.v1.get_variable("w", [len(embs) * FIELDS * DIM + DENSE, 1],
                                  initializer=tf.compat.v1.glorot_uniform_initializer(seed=7))
    pred = tf.squeeze(tf.matmul(tf.concat(embs + [batch["x"]], 1), w), 1)
    return tf.reduce_mean(tf.square(pred - batch["y"])), w


def main():
    """Each --opt and each --mode in turn, in this one process (one start of MPI and TensorFlow)."""
    args = parse()
    tf.compat.v1.disable_eager_execution()
    for mode in args.modes.split(","):
        for opt in args.opt.split(","):
            tf.compat.v1.reset_default_graph()
            train(args, opt, mode, f"{args.tag}-{opt}-{mode}")


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("tag")
    p.add_argument("--sharding")
    p.add_argument("--last-rank-sharding", help="--sharding of the last rank alone (ranks that disagree)")
    p.add_argument("--plan")
    p.add_argument("--groups", default="", help="each table's sharding_group: a=g,b=g")
    p.add_argument("--opt", default="sgd", help="sgd, lazy_adam or both (sgd,lazy_adam)")
    p.add_argument("--modes", default="plain", help="plain, admission, expansion, static (shapes: send_count), or "
                   "several (plain,admission)")
    p.add_argument("--save")
    p.add_argument("--restore")
    p.add_argument("--value-dtype", default="float32", help="the tables' value_dtype (stochastic rounding)")
    p.add_argument("--last-rank-exchange-dtype", default="float32", help="the last rank's tables' exchange_dtype "
                   "(ranks that disagree)")
    return p.parse_args()


def train(args, opt, mode, tag):
    init(use_dynamic_expansion=mode == "expansion", use_dynamic=mode != "static", sharding_plan=args.plan)
    rank, size = get_rank_id(), get_rank_size()
    data, local = my_slice(global_data(), rank, size)
    threshold = 2 if mode == "admission" else None
    specs = [FeatureSpec(name, table_name=name, access_threshold=threshold) for name in TABLES]
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(local, drop_remainder=True)
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset.map(get_asc_insert_func(specs, is_training=True)))
    batch = iterator.get_next()
    given = shardings(args.last_rank_sharding if args.last_rank_sharding and rank == size - 1 else args.sharding, size)
    groups = dict(item.split("=") for item in filter(None, args.groups.split(",")))
    tables = [create_table(tf.int64, DIM, name, tf.compat.v1.constant_initializer(0.1), device_vocabulary_size=120,
                           all2all_gradients_op="sum_gradients_and_div_by_ranksize", value_dtype=args.value_dtype,
                           sharding=given.get(name, (None, None))[0], sharding_rank=given.get(name, (None, None))[1],
                           sharding_group=groups.get(name),
                           exchange_dtype=args.last_rank_exchange_dtype if rank == size - 1 else "float32")
              for name in TABLES]
    loss, w = model(batch, tables, specs, send_count=local * FIELDS if mode == "static" else None)
    dense, sparse = get_dense_and_sparse_variable()
    make = lazy_adam.create_hash_optimizer if opt == "lazy_adam" else gradient_descent.create_hash_optimizer
    train_op = tf.group(
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05)).minimize(loss, var_list=dense),
        make(LEARNING_RATES[opt]).apply_gradients(zip(tf.gradients(loss, sparse), sparse)))
    saver = tf.compat.v1.train.Saver()
    start_asc_pipeline()
    steps = 0
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_variables(dense, root_rank=0))
        if args.restore:
            saver.restore(sess, args.restore)
        else:
            sess.run(iterator.initializer)
            while True:
                try:
                    sess.run(train_op)
                    steps += 1
                except tf.errors.OutOfRangeError:
                    break
        if args.save:
            saver.save(sess, args.save, global_step=steps)
        out = {"w": sess.run(w), "steps": steps}
        for table in tables:
            out.update({f"{table.table_name}.{column}": np.asarray(rows, np.float32) if column != "keys" else rows
                        for column, rows in table.export(sess).items()})
            out[f"{table.table_name}.placement"] = table.placement.describe()
            out[f"{table.table_name}.global_size"] = table.global_size()
    np.savez(os.path.join(args.out, f"{tag}-rank{rank}-of{size}.npz"), **out)
    terminate_config_initializer()


if __name__ == "__main__":
    main()
