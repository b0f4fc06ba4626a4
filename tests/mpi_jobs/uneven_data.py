"""Rank r has 6 + 3r training batches and 2 + r eval batches: every rank must stop each pass at
the same batch, with no hang. Prints one STOP line per rank and pass."""
import time

import numpy as np
import tensorflow as tf

from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_rank_id, init, sparse_lookup,
                          start_asc_pipeline, terminate_config_initializer)


def pipeline(name, batches, is_training, rank):
    ids = np.arange(batches * 8 * 2).reshape(batches * 8, 2) * (rank + 1)
    spec = FeatureSpec("ids", table_name="t")
    dataset = tf.data.Dataset.from_tensor_slices({"ids": ids}).batch(8).map(
        get_asc_insert_func([spec], is_training=is_training)).prefetch(4)
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    return iterator, iterator.get_next(), spec


if __name__ == "__main__":
    tf.compat.v1.disable_eager_execution()
    init()
    rank = get_rank_id()
    train_it, train_batch, train_spec = pipeline("train", 6 + 3 * rank, True, rank)
    eval_it, eval_batch, eval_spec = pipeline("eval", 2 + rank, False, rank)
    table = create_table(tf.int64, 4, "t", tf.compat.v1.ones_initializer(), device_vocabulary_size=1000)
    train_out = tf.reduce_sum(sparse_lookup(table, train_spec, batch=train_batch))
    eval_out = tf.reduce_sum(sparse_lookup(table, eval_spec, batch=eval_batch, is_train=False))
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for name, it, out in (("train", train_it, train_out), ("eval", eval_it, eval_out), ("train", train_it, train_out)):
            sess.run(it.initializer)
            start, steps = time.time(), 0
            while True:
                try:
                    sess.run(out)
                    steps += 1
                except tf.errors.OutOfRangeError:
                    break
            print(f"STOP rank={rank} pass={name} steps={steps} seconds={time.time() - start:.2f}", flush=True)
    terminate_config_initializer()
