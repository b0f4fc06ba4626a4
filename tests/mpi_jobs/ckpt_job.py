"""Deterministic training over fixed global batches [start, end), with an optional restore before
and save after; dumps what every rank holds afterwards.

    mpiexec -np N python ckpt_job.py --out DIR --tag T --start S --end E [--restore PATH] [--save PREFIX]
                                     [--per-rank-prefix] [--dim D] [--optimizer lazy_adam|sgd]
                                     [--restore-latest DIR] [--catch-restore] [--rank1-save PREFIX]
                                     [--catch-save] [--value-dtype float16|bfloat16] [--slot-dtype bfloat16]

--restore-latest DIR restores tf.train.latest_checkpoint(DIR), which every rank prints after its
save as "LATEST rank=<r> path=<file name>". --catch-restore: a failing restore prints
"REFUSED rank=<r> keys=<keys held> w_kept=<0|1>: <message>" and the job ends there with status 0.
--rank1-save PREFIX: rank 1 saves there instead; --catch-save: a failing save prints
"SAVE-REFUSED rank=<r>: <message>" and the job ends with status 0.

Writes DIR/T-rank<r>-of<N>.npz: per table its keys and the rows of values and slots, the losses of
the steps run, and the dense weights. --save PREFIX writes PREFIX-<end> (PREFIX-<rank>-<end> with
--per-rank-prefix, as seed 001 does).
"""
import argparse
import os

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from mx_rec.optimizers import gradient_descent, lazy_adam
from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable, get_rank_id,
                          get_rank_size, init, sparse_lookup, start_asc_pipeline, terminate_config_initializer)

GLOBAL_BATCH, TOTAL_STEPS, FIELDS, DENSE = 16, 40, 3, 4


def global_data():
    rng = np.random.default_rng(7)
    pool = np.concatenate([rng.integers(-(2**40), 2**40, size=300), np.arange(-20, 20)])
    ids = pool[np.minimum(rng.geometric(0.02, size=(TOTAL_STEPS * GLOBAL_BATCH, FIELDS)) - 1, len(pool) - 1)]
    x = rng.normal(size=(TOTAL_STEPS * GLOBAL_BATCH, DENSE)).astype(np.float32)
    y = rng.normal(size=TOTAL_STEPS * GLOBAL_BATCH).astype(np.float32)
    return {"ids": ids.astype(np.int64), "wide": (ids[:, :1] * 3).astype(np.int64), "x": x, "y": y}


def my_batches(start, end, rank, size):
    data = global_data()
    local = GLOBAL_BATCH // size
    rows = np.concatenate([np.arange(s * GLOBAL_BATCH + rank * local, s * GLOBAL_BATCH + (rank + 1) * local)
                           for s in range(start, end)] or [np.zeros(0, np.int64)]).astype(np.int64)
    return {k: v[rows] for k, v in data.items()}, local


def build(dim=4, optimizer="lazy_adam", start=0, end=0, vocab=2000, value_dtype="float32", slot_dtype=None):
    """The job's graph in the default graph (after init()): a dict of what the job runs."""
    rank, size = get_rank_id(), get_rank_size()
    data, local = my_batches(start, end, rank, size)
    specs = [FeatureSpec("ids", table_name="emb"), FeatureSpec("wide", table_name="wide")]
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(local, drop_remainder=True)
    dataset = dataset.map(get_asc_insert_func(specs, is_training=True)).prefetch(4)
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    batch = iterator.get_next()
    emb_table = create_table(tf.int64, dim, "emb", tf.compat.v1.truncated_normal_initializer(stddev=0.1, seed=2),
                             device_vocabulary_size=vocab, all2all_gradients_op="sum_gradients_and_div_by_ranksize",
                             value_dtype=value_dtype, slot_dtype=slot_dtype)
    wide_table = create_table(tf.int64, 1, "wide", tf.compat.v1.truncated_normal_initializer(stddev=0.1, seed=3),
                              device_vocabulary_size=1000, all2all_gradients_op="sum_gradients_and_div_by_ranksize")
    emb = sparse_lookup(emb_table, specs[0], batch=batch)
    wide = sparse_lookup(wide_table, specs[1], batch=batch)
    w = tf.compat.v1.get_variable("w", [FIELDS * dim + DENSE, 1],
                                  initializer=tf.compat.v1.glorot_uniform_initializer(seed=7))
    pred = tf.squeeze(tf.matmul(tf.concat([tf.reshape(emb, [-1, FIELDS * dim]), batch["x"]], 1), w), 1)
    loss = tf.reduce_mean(tf.square(pred + tf.reduce_sum(wide, [1, 2]) - batch["y"]))
    dense, sparse = get_dense_and_sparse_variable()
    step = tf.compat.v1.train.get_or_create_global_step()
    sparse_opt = (lazy_adam.create_hash_optimizer(0.02) if optimizer == "lazy_adam"
                  else gradient_descent.create_hash_optimizer(0.1))
    train_op = tf.group(hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05)).minimize(
                            loss, var_list=dense, global_step=step),
                        sparse_opt.apply_gradients(zip(tf.gradients(loss, sparse), sparse)))
    return {"iterator": iterator, "train_op": train_op, "loss": loss, "saver": tf.compat.v1.train.Saver(),
            "tables": (emb_table, wide_table), "w": w, "step": step, "dense": dense}


def dump(sess, g):
    """What this rank holds: every table's keys with their rows of values and slots, and w."""
    out = {"w": sess.run(g["w"]), "step": sess.run(g["step"])}
    for table in g["tables"]:
        keys, rows_at = table.index.export()
        out[f"{table.table_name}.keys"] = keys
        # float32 (exact for 16-bit rows): an .npz holds no bfloat16
        out[f"{table.table_name}.values"] = sess.run(table.variable)[rows_at].astype(np.float32)
        for slot, var in table.slots.items():
            out[f"{table.table_name}.{slot}"] = sess.run(var)[rows_at].astype(np.float32)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--end", type=int, default=0)
    p.add_argument("--restore")
    p.add_argument("--restore-latest")
    p.add_argument("--catch-restore", action="store_true")
    p.add_argument("--rank1-save")
    p.add_argument("--catch-save", action="store_true")
    p.add_argument("--save")
    p.add_argument("--per-rank-prefix", action="store_true")
    p.add_argument("--dim", type=int, default=4)
    p.add_argument("--optimizer", default="lazy_adam", choices=["lazy_adam", "sgd"])
    p.add_argument("--extra-keys", type=int, default=0, help="keys added to 'emb' before saving (a big save)")
    p.add_argument("--vocab", type=int, default=2000, help="device_vocabulary_size of 'emb'")
    p.add_argument("--value-dtype", default="float32", help="value_dtype of 'emb'")
    p.add_argument("--slot-dtype", default=None, help="slot_dtype of 'emb'")
    args = p.parse_args()

    tf.compat.v1.disable_eager_execution()
    tf.compat.v1.set_random_seed(5)
    init()
    rank, size = get_rank_id(), get_rank_size()
    g = build(args.dim, args.optimizer, args.start, args.end, args.vocab, args.value_dtype, args.slot_dtype)
    start_asc_pipeline()
    losses = []
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_variables(g["dense"], root_rank=0))
        restore = tf.train.latest_checkpoint(args.restore_latest) if args.restore_latest else args.restore
        if restore:
            w_before = sess.run(g["w"])
            try:
                g["saver"].restore(sess, restore)
            except Exception as e:
                if not args.catch_restore:
                    raise
                held = sum(t.size() for t in g["tables"])
                kept = int(np.array_equal(sess.run(g["w"]), w_before))
                print(f"REFUSED rank={rank} keys={held} w_kept={kept}: {e}", flush=True)
                return
        sess.run(g["iterator"].initializer)
        for _ in range(args.start, args.end):
            losses.append(sess.run([g["train_op"], g["loss"]])[1])
        if args.extra_keys:
            keys = np.arange(args.extra_keys, dtype=np.int64) * size + rank
            g["tables"][0].index.lookup(keys, allocate=True)
        if args.save:
            prefix = f"{args.save}-{rank}" if args.per_rank_prefix else args.save
            if rank == 1 and args.rank1_save:
                prefix = args.rank1_save
            try:
                g["saver"].save(sess, prefix, global_step=args.end)
            except Exception as e:
                if not args.catch_save:
                    raise
                print(f"SAVE-REFUSED rank={rank}: {e}", flush=True)
                return
            latest = tf.train.latest_checkpoint(os.path.dirname(os.path.abspath(prefix)))
            print(f"LATEST rank={rank} path={os.path.basename(latest or 'None')}", flush=True)
        out = dump(sess, g)
    np.savez(os.path.join(args.out, f"{args.tag}-rank{rank}-of{size}.npz"), losses=np.array(losses, np.float32), **out)
    terminate_config_initializer()


if __name__ == "__main__":
    main()
