"""Checkpoint speed: tf.compat.v1.train.Saver save and restore of one rank's 5M-key table (dim 16,
lazy Adam slots), in MB/s of files written / read. One process; prints one JSON line.

    python bench/checkpoint.py --keys 5000000 --dir DIR
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402

DIM = 16


def build(keys):
    from mx_rec.optimizers import lazy_adam
    from shardrec.rank_runtime import create_table

    table = create_table(tf.int64, DIM, "emb", tf.compat.v1.truncated_normal_initializer(stddev=0.05, seed=1),
                         device_vocabulary_size=keys)
    # One update creates the Adam slots that a trained table has; its row stays as it was.
    grad = tf.IndexedSlices(tf.zeros([1, DIM]), tf.constant([0], tf.int32), tf.constant([keys + 1, DIM]))
    update = lazy_adam.create_hash_optimizer(0.001).apply_gradients([(grad, table.variable)])
    return table, update, tf.compat.v1.train.Saver()


def drop_cache(directory):
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--keys", type=int, default=5_000_000)
    p.add_argument("--dir", required=True)
    args = p.parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    from shardrec.rank_runtime import init
    from shardrec.rank_runtime.sparse_checkpoint import sparse_dir

    init()
    keys = np.unique(workload.KEY_RANGE // 3 + np.arange(args.keys, dtype=np.int64) * 7919)
    with tf.Graph().as_default():
        table, update, saver = build(args.keys)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(update)
            table.index.lookup(keys, allocate=True)
            start = time.perf_counter()
            path = saver.save(sess, os.path.join(args.dir, "model"), global_step=1, write_meta_graph=False)
            save_s = time.perf_counter() - start
    shard = sparse_dir(path)
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(shard) for f in fs)
    drop_cache(args.dir)
    with tf.Graph().as_default():
        table, _, saver = build(args.keys)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            start = time.perf_counter()
            saver.restore(sess, path)
            restore_s = time.perf_counter() - start
            assert table.size() == len(keys)
    print(json.dumps({"keys": len(keys), "bytes": size, "save_s": save_s, "restore_s": restore_s,
                      "save_mb_s": size / 2**20 / save_s, "restore_mb_s": size / 2**20 / restore_s}), flush=True)


if __name__ == "__main__":
    main()
