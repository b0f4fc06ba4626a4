"""Trains from a DirectoryStream (or, with --broker, a RedisStream; with --parquet, a ParquetDataset
of the Parquet files in --stream; with --parquet-stream, a ParquetDirectoryStream) until it is idle (or the files end), saving every
--every steps; dumps what every rank holds at the end.

    mpiexec -np N python stream_job.py --stream DIR|NAME --partitions P --out DIR --tag T --model DIR
                                       [--broker URL] [--every K] [--die-at STEP] [--optimizer sgd|lazy_adam]
                                       [--idle S] [--access-threshold N] [--parquet | --parquet-stream]

Restores tf.train.latest_checkpoint(--model) when there is one. --die-at STEP: rank 1 SIGKILLs
itself after the step that makes the global step STEP (a rank lost mid-run; under shardrec-run, in
the first attempt only). --idle 0: the stream waits for data for ever (the job runs until it is
stopped). --step-delay S: a pause after every step, for tests that act on a running job.
--wrong-step-at STEP: a save with global_step one lower than the graph's, which must fail.
--die-in-save STEP: rank 1 SIGKILLs itself inside its save of STEP, its arrays written and its
manifest not (in attempt --die-in-save-attempt, the first by default). --stop-at STEP: the job
saves and ends at STEP, as a resize does (a phase of a reference run). Writes
DIR/T-rank<r>-of<N>.npz: the table's keys, values (and slots) and access counts, the final step,
and the records this process trained.
"""
import argparse
import os
import signal
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from mx_rec.optimizers import gradient_descent, lazy_adam
from shardrec.rank_runtime import (DirectoryStream, FeatureSpec, ParquetDataset, ParquetDirectoryStream, RedisStream,
                                   Saver, create_table, get_asc_insert_func, get_dense_and_sparse_variable, get_rank_id,
                                   get_rank_size, init, report, sparse_lookup, start_asc_pipeline)
from shardrec.rank_runtime.stream.partitioned import training_stream

FIELDS, DIM, BATCH = 3, 4, 8


def parse(records):
    return tf.io.parse_example(records, {"ids": tf.io.FixedLenFeature([FIELDS], tf.int64),
                                         "y": tf.io.FixedLenFeature([], tf.float32)})


def die_in_save(name):
    from shardrec.rank_runtime.formats import sparse_checkpoint

    fsync_tree = sparse_checkpoint._fsync_tree

    def then_die(path):
        fsync_tree(path)
        if f"sparse-{name}." in path:
            os.kill(os.getpid(), signal.SIGKILL)
    sparse_checkpoint._fsync_tree = then_die


def main():
    p = argparse.ArgumentParser()
    for name in ("--stream", "--out", "--tag", "--model"):
        p.add_argument(name, required=True)
    p.add_argument("--partitions", type=int, required=True)
    p.add_argument("--broker", help="a Redis URL: --stream names its streams")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--die-at", type=int)
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "lazy_adam"])
    p.add_argument("--idle", type=float, default=3.0)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--die-in-save", type=int)
    p.add_argument("--die-in-save-attempt", type=int, default=0)
    p.add_argument("--parquet", action="store_true", help="--stream is a directory of Parquet files (ids, y)")
    p.add_argument("--parquet-stream", action="store_true",
                   help="--stream is a directory stream of Parquet files (ids0..ids2, y)")
    p.add_argument("--stop-at", type=int, help="save and end after the step that makes the global step this")
    p.add_argument("--access-threshold", type=int, default=-1, help="admission: occurrences before a key gets a row")
    p.add_argument("--wrong-step-at", type=int, help="after the step that makes the global step this, a save that "
                                                      "passes global_step one lower, which must be refused")
    args = p.parse_args()

    tf.compat.v1.disable_eager_execution()
    tf.compat.v1.set_random_seed(5)
    init()
    rank, size = get_rank_id(), get_rank_size()
    idle = args.idle or None
    attempt = int(os.environ.get("SHARDREC_ATTEMPT", "0"))
    if args.die_in_save is not None and rank == 1 and attempt == args.die_in_save_attempt:
        die_in_save(f"model-{args.die_in_save}")
    spec = FeatureSpec("ids", table_name="emb", access_threshold=args.access_threshold)
    if args.parquet:
        batches = ParquetDataset(args.stream, BATCH, {"ids": "ids", "y": "float"}, partitions=args.partitions)
        stream = training_stream()
    elif args.parquet_stream:
        stream = ParquetDirectoryStream(args.stream, args.partitions, BATCH,
                                        {"ids": ("id", [f"ids{i}" for i in range(FIELDS)]), "y": "float"},
                                        idle_timeout_s=idle, poll_s=0.05)
        batches = stream.dataset()
    elif args.broker:
        stream = RedisStream(args.broker, args.stream, args.partitions, idle_timeout_s=idle, poll_s=0.05,
                             block_entries=16)
    else:
        stream = DirectoryStream(args.stream, args.partitions, idle_timeout_s=idle, poll_s=0.05)
    if not (args.parquet or args.parquet_stream):
        batches = stream.dataset().batch(BATCH).map(parse)
    dataset = batches.map(get_asc_insert_func([spec], is_training=True))
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset.prefetch(2))
    batch = iterator.get_next()
    table = create_table(tf.int64, DIM, "emb", tf.compat.v1.truncated_normal_initializer(stddev=0.1, seed=2),
                         device_vocabulary_size=5000, all2all_gradients_op="sum_gradients_and_div_by_ranksize")
    emb = sparse_lookup(table, spec, batch=batch)
    w = tf.compat.v1.get_variable("w", [FIELDS * DIM, 1], initializer=tf.compat.v1.glorot_uniform_initializer(seed=7))
    pred = tf.squeeze(tf.matmul(tf.reshape(emb, [-1, FIELDS * DIM]), w), 1)
    loss = tf.reduce_mean(tf.square(pred - batch["y"]))
    dense, sparse = get_dense_and_sparse_variable()
    step = tf.compat.v1.train.get_or_create_global_step()
    sparse_opt = (lazy_adam.create_hash_optimizer(0.02) if args.optimizer == "lazy_adam"
                  else gradient_descent.create_hash_optimizer(0.1))
    train_op = tf.group(hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05)).minimize(
                            loss, var_list=dense, global_step=step),
                        sparse_opt.apply_gradients(zip(tf.gradients(loss, sparse), sparse)))
    saver = Saver(max_to_keep=3)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_variables(dense, root_rank=0))
        latest = tf.train.latest_checkpoint(args.model)
        if latest:
            saver.restore(sess, latest)
        sess.run(iterator.initializer)
        at = int(sess.run(step))
        while True:
            try:
                sess.run(train_op)
            except tf.errors.OutOfRangeError:
                break
            at += 1
            report(step=at)
            time.sleep(args.step_delay)
            if args.die_at == at and rank == 1 and attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.stop_at == at:
                break
            if args.wrong_step_at == at:
                try:
                    saver.save(sess, os.path.join(args.model, "model"), global_step=at - 1)
                except ValueError as e:  # a CheckpointError on more than one rank: every rank learns it
                    print(f"WRONG-STEP-REFUSED rank {rank}: {e}", flush=True)
                else:
                    raise AssertionError(f"a save of global_step={at - 1} at the graph's global step {at} was taken")
            if at % args.every == 0:
                saver.save(sess, os.path.join(args.model, "model"), global_step=at)
        saver.save(sess, os.path.join(args.model, "model"), global_step=at)
        keys, rows_at = table.index.export()
        out = {"keys": keys, "values": sess.run(table.variable)[rows_at], "step": at, "w": sess.run(w),
               "records": stream.cursor.records_trained}
        for slot, var in table.slots.items():
            out[slot] = sess.run(var)[rows_at]
        np.savez(os.path.join(args.out, f"{args.tag}-rank{rank}-of{size}.npz"), **out)


if __name__ == "__main__":
    main()
