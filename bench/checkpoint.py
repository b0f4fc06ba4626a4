"""Checkpoint speed: tf.compat.v1.train.Saver save and restore of one rank's 5M-key table (dim 16,
lazy Adam slots), in MB/s of files written / read, against the disk's ceiling for the same bytes
in the same files: a plain write + fsync of the same arrays, and a plain read of the checkpoint's
own files from a dropped page cache. One process; prints one JSON line.

    python bench/checkpoint.py --keys 5000000 --dir DIR [--repeats 2]

Saves and plain writes alternate (plain, save, plain, save, ...): how fast a file is written
depends on the page cache's state (a first write into fresh page cache ran at ~370 MB/s here, a
rewrite at ~2.2 GB/s), so both see the same conditions; each figure is the median.
"""
import argparse
import json
import os
import shutil
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


def plain_write(directory, arrays):
    """The disk's ceiling for a save: the same arrays, one file each, written and fsync'ed."""
    os.makedirs(directory)
    start = time.perf_counter()
    for name, array in arrays.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(memoryview(np.ascontiguousarray(array).reshape(-1)).cast("B"))
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start


def plain_read(directory):
    """The disk's ceiling for a restore: every file of `directory` read, page cache dropped first."""
    drop_cache(directory)
    start = time.perf_counter()
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(64 * 2**20):
                    pass
    return time.perf_counter() - start


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
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    from shardrec.rank_runtime import init
    from shardrec.rank_runtime.checkpoint.table_save import read_table_rows
    from shardrec.rank_runtime.formats.sparse_checkpoint import sparse_dir

    init()
    keys = np.unique(workload.KEY_RANGE // 3 + np.arange(args.keys, dtype=np.int64) * 7919)
    save_s, write_s = [], []
    with tf.Graph().as_default():
        table, update, saver = build(args.keys)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(update)
            table.index.lookup(keys, allocate=True)
            arrays = read_table_rows(sess, table)
            for i in range(args.repeats):
                plain = os.path.join(args.dir, f"plain-{i}")
                write_s.append(plain_write(plain, arrays))
                shutil.rmtree(plain)
                start = time.perf_counter()
                path = saver.save(sess, os.path.join(args.dir, "model"), global_step=i, write_meta_graph=False)
                save_s.append(time.perf_counter() - start)
    shard = sparse_dir(path)
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(shard) for f in fs)
    read_s = plain_read(shard)
    drop_cache(args.dir)
    with tf.Graph().as_default():
        table, _, saver = build(args.keys)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            start = time.perf_counter()
            saver.restore(sess, path)
            restore_s = time.perf_counter() - start
            assert table.size() == len(keys)
    mb = size / 2**20
    save, write = float(np.median(save_s)), float(np.median(write_s))
    print(json.dumps({"keys": len(keys), "bytes": size, "save_s": save, "restore_s": restore_s,
                      "save_mb_s": mb / save, "plain_write_mb_s": mb / write, "restore_mb_s": mb / restore_s,
                      "plain_read_mb_s": mb / read_s, "save_samples_s": save_s, "plain_write_samples_s": write_s}),
          flush=True)


if __name__ == "__main__":
    main()
