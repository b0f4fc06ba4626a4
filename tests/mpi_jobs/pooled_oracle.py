"""Variable-length ids pooled on the owner, trained over fixed global batches, each rank taking its
slice of every global batch. Writes, per configuration and rank, the keys this rank holds and their
rows; test_pooled_lookup.py trains tf.nn.embedding_lookup_sparse on a plain variable over the
same global batches and compares.

    mpiexec -np N python pooled_oracle.py OUT_DIR CONFIG [CONFIG ...]

CONFIG is FORM-COMBINER-WEIGHTS-OPT[-admission|-eviction|-expansion|-static|-tablewise|-replicated]: FORM ragged (a ragged_batch dataset,
FeatureSpec mode), sparse (a SparseTensor element, FeatureSpec mode) or graph (modify_graph=True
on ragged ids); COMBINER sum, mean or sqrtn; WEIGHTS w or now; OPT sgd or lazy_adam.
"""
import os
import sys

import numpy as np
import tensorflow as tf

from mx_rec.optimizers import gradient_descent, lazy_adam
from mx_rec.core.feature_process import EvictHook
from mx_rec.graph.modifier import modify_graph_and_start_emb_cache
from mx_rec.util.initialize import get_initializer
from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable,
                                   get_rank_id, get_rank_size, init, sparse_lookup, start_asc_pipeline)
from shardrec.rank_runtime.process import lifecycle

GLOBAL_BATCH, STEPS, DIM, MAX_IDS, ACCESS = 12, 50, 4, 7, 2
EVICT_AGE, EVICT_EVERY, SECONDS_PER_BATCH = 60, 5, 10  # eviction: keys unseen for 6 batches, every 5 steps
LEARNING_RATES = {"sgd": 0.1, "lazy_adam": 0.02}
PROJECTION = np.linspace(-1.0, 1.5, DIM).astype(np.float32)


def global_data():
    """Per example 0..MAX_IDS ids (empty examples and ids repeated within an example included) from a
    skewed pool, per-id weights in [0.5, 2), a target per example."""
    rng = np.random.default_rng(41)
    pool = np.concatenate([rng.integers(-(2**40), 2**40, size=30), np.arange(-5, 5)]).astype(np.int64)
    lengths = rng.integers(0, MAX_IDS + 1, size=STEPS * GLOBAL_BATCH)
    lengths[::9] = 0
    ids = pool[np.minimum(rng.geometric(0.08, size=lengths.sum()) - 1, len(pool) - 1)]
    weights = rng.uniform(0.5, 2.0, size=lengths.sum()).astype(np.float32)
    splits = np.concatenate([[0], np.cumsum(lengths)])
    y = rng.normal(size=STEPS * GLOBAL_BATCH).astype(np.float32)
    return ids, weights, splits, y


def my_examples(rank, size):
    local = GLOBAL_BATCH // size
    return np.concatenate([np.arange(s * GLOBAL_BATCH + rank * local, s * GLOBAL_BATCH + (rank + 1) * local)
                           for s in range(STEPS)]), local


def dataset_of(form, rank, size):
    ids, weights, splits, y = global_data()
    examples, local = my_examples(rank, size)
    per = [slice(splits[e], splits[e + 1]) for e in examples]
    ragged_ids = tf.ragged.constant([ids[s] for s in per], dtype=tf.int64, row_splits_dtype=tf.int64)
    ragged_w = tf.ragged.constant([weights[s] for s in per], dtype=tf.float32, row_splits_dtype=tf.int64)
    ts = (examples // GLOBAL_BATCH * SECONDS_PER_BATCH).astype(np.int64)
    data = tf.data.Dataset.from_tensor_slices({"ids": ragged_ids, "w": ragged_w, "y": y[examples], "ts": ts})
    data = data.ragged_batch(local, drop_remainder=True)
    if form == "sparse":
        data = data.map(lambda b: dict(b, ids=b["ids"].to_sparse(), w=b["w"].to_sparse()))
    return data


def train(config, out_dir):
    form, combiner, weighted, opt, *extra = config.split("-")
    tf.compat.v1.reset_default_graph()
    init(use_dynamic_expansion="expansion" in extra, use_dynamic="static" not in extra)
    rank, size = get_rank_id(), get_rank_size()
    data = dataset_of(form, rank, size)
    access = ACCESS if "admission" in extra or "eviction" in extra else None
    # Static shapes: send_count bounds the distinct ids a rank sends one owner in a batch.
    send_count = GLOBAL_BATCH * MAX_IDS if "static" in extra else None
    # tablewise: the whole table on the last rank; replicated: on every rank; columnwise: half of each
    # row's columns on each of the last two ranks (docs/guide/sharding.md).
    placed = {"sharding": "table_wise", "sharding_rank": size - 1} if "tablewise" in extra else \
        {"sharding": "replicated"} if "replicated" in extra else \
        {"sharding": "column_wise", "sharding_rank": list(range(max(0, size - 2), size))} if "columnwise" in extra \
        else {}
    table = create_table(tf.int64, DIM, "emb", tf.compat.v1.constant_initializer(0.1),
                         device_vocabulary_size=8 * size if "expansion" in extra else 256, **placed)
    if form == "graph":
        iterator = tf.compat.v1.data.make_initializable_iterator(data)
        batch = iterator.get_next()
        emb = sparse_lookup(table, batch["ids"], send_count, modify_graph=True, combiner=combiner,
                            weights=batch["w"] if weighted == "w" else None,
                            access_and_evict_config={"access_threshold": access, "eviction_threshold": -1}
                            if access else None)
    else:
        evicts = "eviction" in extra
        spec = FeatureSpec("ids", table_name="emb", access_threshold=access,
                           eviction_threshold=EVICT_AGE if evicts else None)
        stamps = [FeatureSpec("ts", is_timestamp=True)] if evicts else []
        iterator = tf.compat.v1.data.make_initializable_iterator(
            data.map(get_asc_insert_func([spec] + stamps, is_training=True)))
        batch = iterator.get_next()
        emb = sparse_lookup(table, spec, send_count, batch=batch, combiner=combiner,
                            weights=batch["w"] if weighted == "w" else None)
    loss = tf.reduce_sum(tf.square(tf.reduce_sum(emb * PROJECTION, 1) - batch["y"])) / GLOBAL_BATCH
    _, sparse = get_dense_and_sparse_variable()
    make = gradient_descent.create_hash_optimizer if opt == "sgd" else lazy_adam.create_hash_optimizer
    step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.group(make(LEARNING_RATES[opt]).apply_gradients(zip(tf.gradients(loss, sparse), sparse)),
                        step.assign_add(1))
    if form == "graph":
        modify_graph_and_start_emb_cache()
        initializer = get_initializer(True)
    else:
        start_asc_pipeline()
        initializer = iterator.initializer
    # EvictHook evicts every EVICT_EVERY steps (by the data's timestamps); it runs in any config.
    hooks = [EvictHook(evict_step_interval=EVICT_EVERY, evict_time_interval=None)] if "eviction" in extra else []
    scaffold = tf.compat.v1.train.Scaffold(local_init_op=initializer)
    with tf.compat.v1.train.SingularMonitoredSession(hooks=hooks, scaffold=scaffold) as sess:
        steps = 0
        while not sess.should_stop():
            try:
                sess.run(train_op)
                steps += 1
            except tf.errors.OutOfRangeError:
                break
        held = table.export(sess.raw_session())
    columns = table.held_columns  # a column-wise table's rank holds these columns of its keys' rows
    np.savez(os.path.join(out_dir, f"{config}-rank{rank}-of{size}.npz"), keys=held["keys"], rows=held["values"],
             steps=steps, capacity=table.capacity(), columns=[columns.start, columns.stop])
    lifecycle.terminate_config_initializer()


if __name__ == "__main__":
    tf.compat.v1.disable_eager_execution()
    for config in sys.argv[2:]:
        train(config, sys.argv[1])
