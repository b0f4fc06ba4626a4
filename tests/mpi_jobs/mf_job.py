"""Matrix factorization: two tables (user, item) and a dot product, trained with SGD. No dense
variable, no global step, no optimizer state beyond the rows: a model of tables alone.

    mpiexec -np N python mf_job.py DIR train --saves f6,d9,f12 [--plain]
    mpiexec -np N python mf_job.py DIR restore --path P --tag T

train: steps 0..max(saves) over fixed global batches split by rank; after step s of --saves it saves
DIR/mf-s (Saver.save(sess, DIR/mf, global_step=s, save_delta=...): f full, d a delta; --plain: init
without incremental checkpoints) and dumps what this rank holds to DIR/train-s-rank<r>-of<N>.npz.
restore: a plain Session restores P and dumps to DIR/T-rank<r>-of<N>.npz.
"""
import argparse
import os

import numpy as np
import tensorflow as tf

from mx_rec.core.asc.feature_spec import FeatureSpec
from mx_rec.core.asc.helper import get_asc_insert_func
from mx_rec.core.asc.manager import start_asc_pipeline
from mx_rec.core.embedding import create_table, sparse_lookup
from mx_rec.optimizers.gradient_descent import create_hash_optimizer
from mx_rec.util.initialize import get_rank_id, get_rank_size, init, terminate_config_initializer
from mx_rec.util.variable import get_dense_and_sparse_variable

DIM, GLOBAL_BATCH, STEPS = 4, 24, 12


def ratings():
    rng = np.random.default_rng(11)
    users = rng.integers(0, 60, size=(STEPS * GLOBAL_BATCH, 1)).astype(np.int64)
    items = (rng.integers(0, 90, size=(STEPS * GLOBAL_BATCH, 1)) * 7 + 3).astype(np.int64)
    return users, items, rng.uniform(1, 5, size=STEPS * GLOBAL_BATCH).astype(np.float32)


def tables():
    """The model's two tables, for training and for the export alike."""
    user_table = create_table(tf.int64, DIM, "user", tf.compat.v1.truncated_normal_initializer(stddev=0.5, seed=1),
                              device_vocabulary_size=512)
    item_table = create_table(tf.int64, DIM, "item", tf.compat.v1.truncated_normal_initializer(stddev=0.5, seed=2),
                              device_vocabulary_size=512)
    return user_table, item_table


def build():
    rank, size = get_rank_id(), get_rank_size()
    users, items, rates = ratings()
    local = GLOBAL_BATCH // size
    rows = np.concatenate([np.arange(s * GLOBAL_BATCH + rank * local, s * GLOBAL_BATCH + (rank + 1) * local)
                           for s in range(STEPS)])
    specs = [FeatureSpec("user", table_name="user"), FeatureSpec("item", table_name="item")]
    dataset = tf.data.Dataset.from_tensor_slices({"user": users[rows], "item": items[rows], "rate": rates[rows]})
    dataset = dataset.batch(local, drop_remainder=True).map(get_asc_insert_func(specs, is_training=True))
    # No run-ahead: by default tf.data parallelizes the pipeline's last (stateless) map and injects
    # a prefetch after it, which pull batches through the key exchange before training asks for
    # them. A batch exchanged between a save and the dump that follows it would add keys to the
    # dump alone (the save holds the keys of batches exchanged before it, by design), and the test
    # compares the two: the next batch's keys must not arrive before the next step.
    options = tf.data.Options()
    options.experimental_optimization.inject_prefetch = False
    options.experimental_optimization.map_parallelization = False
    dataset = dataset.with_options(options)
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    user_table, item_table = tables()
    u = sparse_lookup(user_table, specs[0], batch=batch, is_train=True)
    v = sparse_lookup(item_table, specs[1], batch=batch, is_train=True)
    loss = tf.reduce_mean(tf.square(tf.reduce_sum(u * v, [1, 2]) - batch["rate"]))
    dense, sparse = get_dense_and_sparse_variable()
    assert not dense, f"a model of tables alone, but dense variables {dense}"
    train = create_hash_optimizer(learning_rate=0.05).apply_gradients(zip(tf.gradients(loss, sparse), sparse))
    start_asc_pipeline()
    return {"tables": (user_table, item_table), "train": train, "saver": tf.compat.v1.train.Saver(max_to_keep=10)}


def serving_outputs(features):
    """shardrec-export's model function: the score of each (user, item) pair."""
    user_table, item_table = tables()
    u = sparse_lookup(user_table, features["user"], is_train=False, name="user")
    v = sparse_lookup(item_table, features["item"], is_train=False, name="item")
    return {"score": tf.reduce_sum(u * v, -1)}


def dump(sess, g, path):
    arrays = {}
    for table in g["tables"]:
        for k, v in table.export(sess).items():
            arrays[f"{table.table_name}_{k.replace('.', '_')}"] = v
    np.savez(path, **arrays)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("mode", choices=["train", "restore"])
    p.add_argument("--saves", default="")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--path")
    p.add_argument("--tag", default="restored")
    a = p.parse_args()
    tf.compat.v1.disable_eager_execution()
    incremental = {} if a.plain or a.mode == "restore" else dict(
        is_incremental_checkpoint=True, save_checkpoint_due_time=3600, save_delta_checkpoints_secs=3600)
    init(**incremental)
    rank, size = get_rank_id(), get_rank_size()
    g = build()
    sess = tf.compat.v1.Session()
    sess.run(tf.compat.v1.global_variables_initializer())
    if a.mode == "restore":
        g["saver"].restore(sess, a.path)
        dump(sess, g, os.path.join(a.dir, f"{a.tag}-rank{rank}-of{size}.npz"))
    else:
        saves = {int(s[1:]): s[0] for s in a.saves.split(",")}
        for step in range(1, max(saves) + 1):
            sess.run(g["train"])
            if step in saves:
                path = g["saver"].save(sess, os.path.join(a.dir, "mf"), global_step=step,
                                       save_delta=None if a.plain else saves[step] == "d")
                print(f"SAVED rank={rank} step={step} path={os.path.basename(path)}", flush=True)
                dump(sess, g, os.path.join(a.dir, f"train-{step}-rank{rank}-of{size}.npz"))
    sess.close()
    terminate_config_initializer()


if __name__ == "__main__":
    main()
