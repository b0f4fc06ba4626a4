"""Trains one table on 200,000 distinct keys, written as a Rec SDK script would be (seed 002).

    mpiexec -np N python expansion_train.py OUT_DIR MODE

MODE fixed: a table of fixed size with room for every key; expand: dynamic expansion from room for
1,000 keys per rank, lazy Adam through get_dense_and_sparse_variable; by_address: dynamic expansion
with the by-address lazy Adam, its gradients taken of the lookups' local rows
(ASCEND_SPARSE_LOOKUP_LOCAL_EMB) and applied at their addresses (ASCEND_SPARSE_LOOKUP_ID_OFFSET), as
seed 002 step 7 shows. The initializer is a constant, so every mode must end with the same rows.
Writes per rank: keys, rows and slots by key, the capacity after each step, resident memory.
"""
import os
import sys

import numpy as np
import psutil
import tensorflow as tf

from mx_rec.constants.constants import ASCEND_SPARSE_LOOKUP_ID_OFFSET, ASCEND_SPARSE_LOOKUP_LOCAL_EMB
from mx_rec.core.asc.feature_spec import FeatureSpec
from mx_rec.core.asc.helper import get_asc_insert_func
from mx_rec.core.asc.manager import start_asc_pipeline
from mx_rec.core.embedding import create_table, sparse_lookup
from mx_rec.optimizers.lazy_adam import create_hash_optimizer
from mx_rec.optimizers.lazy_adam_by_addr import create_hash_optimizer_by_address
from mx_rec.util.initialize import get_rank_id, get_rank_size, init, terminate_config_initializer
from mx_rec.util.variable import get_dense_and_sparse_variable

DISTINCT, GLOBAL_BATCH, DIM = 200_000, 4096, 8
STEPS = -(-DISTINCT // GLOBAL_BATCH) + 1


def global_ids():
    rng = np.random.default_rng(5)
    keys = rng.choice(2**50, size=DISTINCT, replace=False).astype(np.int64) - 2**49
    stream = np.concatenate([keys, rng.choice(keys, size=STEPS * GLOBAL_BATCH - DISTINCT)])
    rng.shuffle(stream)
    return stream.reshape(STEPS, GLOBAL_BATCH)


def main(out_dir, mode):
    tf.compat.v1.disable_eager_execution()
    expands = mode != "fixed"
    init(use_dynamic_expansion=expands)
    rank, size = get_rank_id(), get_rank_size()
    local = GLOBAL_BATCH // size
    ids = global_ids()[:, rank * local:(rank + 1) * local].reshape(-1, 1)
    targets = np.sin(ids.astype(np.float64) % 1000).astype(np.float32).reshape(-1)
    spec = FeatureSpec("ids", table_name="emb")
    dataset = tf.data.Dataset.from_tensor_slices({"ids": ids, "y": targets}).batch(local, drop_remainder=True)
    dataset = dataset.map(get_asc_insert_func(tgt_key_specs=[spec], is_training=True))
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    table = create_table(key_dtype=tf.int64, dim=tf.TensorShape([DIM]), name="emb",
                         emb_initializer=tf.compat.v1.constant_initializer(0.1),
                         device_vocabulary_size=1000 * size if expands else DISTINCT * size)
    emb = sparse_lookup(table, spec, batch=batch, is_train=True)
    weights = tf.constant(np.linspace(-1, 1, DIM), tf.float32)
    loss = tf.reduce_sum(tf.square(tf.reduce_sum(emb * weights, axis=[1, 2]) - batch["y"])) / GLOBAL_BATCH
    if mode == "by_address":
        sparse_optimizer = create_hash_optimizer_by_address(learning_rate=0.05)
        local_embs = tf.compat.v1.get_collection(ASCEND_SPARSE_LOOKUP_LOCAL_EMB)
        addresses = tf.compat.v1.get_collection(ASCEND_SPARSE_LOOKUP_ID_OFFSET)
        assert len(local_embs) == len(addresses) == 1
        grads = tf.gradients(loss, local_embs)
        train_op = sparse_optimizer.apply_gradients(list(zip(grads, addresses)))
    else:
        sparse_optimizer = create_hash_optimizer(learning_rate=0.05)
        _, sparse = get_dense_and_sparse_variable()
        train_op = sparse_optimizer.apply_gradients(zip(tf.gradients(loss, sparse), sparse))
    start_asc_pipeline()
    capacities = []
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        rss_start = psutil.Process().memory_info().rss
        while True:
            try:
                sess.run(train_op)
            except tf.errors.OutOfRangeError:
                break
            except tf.errors.OpError as e:
                # What each rank learned, for the test: every rank must stop with the same error.
                with open(os.path.join(out_dir, f"{mode}-rank{rank}.error"), "w") as f:
                    f.write(e.message)
                raise
            capacities.append(table.capacity())
        rss_end = psutil.Process().memory_info().rss
        rows = table.export(sess)
    np.savez(os.path.join(out_dir, f"{mode}-rank{rank}.npz"), capacities=np.array(capacities),
             rss_start=rss_start, rss_end=rss_end, max_rows=table.max_rows(),
             counters=np.array([table.counters().as_dict()[k] for k in ("value_bytes", "slot_bytes", "metadata_bytes")]),
             **rows)
    terminate_config_initializer()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
