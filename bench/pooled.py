"""Variable-length (multi-hot) features: a lookup pooled on the owners against the padded lookup
of the same data, the way users pad today (`padded_batch` to the batch's longest example, the
padding id looked up like any id, a masked sum in the model). Bytes on the wire come from the row
exchange's own counters (rows out and gradients back, to other ranks) and the key round's
(pooling's id words); step time as CPU time per step (all the rank's threads) and wall time.

    mpiexec -np 2 python bench/pooled.py [--bags 1,4,16,64] [--dims 16,128] [--batch 1024] [--steps 20]

Both lookups train with SGD on one table; each bag holds a uniform draw of 1..2L-1 ids (mean L)
from Zipf(1.1) over a 2^40 key range. The configurations alternate in one process per rank
(pooled, padded, pooled, ...) so that the machine's drift hits both. Rank 0 prints one JSON line
per (bag, dim): per step, bytes to other ranks (rows out and gradients back; pooling's id words),
CPU and wall milliseconds, medians of the rounds; and what one row per padded id would send.
"""
import argparse
import json
import os
import resource
import time

import numpy as np
import tensorflow as tf

from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable,
                                   init, sparse_lookup, start_asc_pipeline)
from shardrec.rank_runtime.embedding import native_ops
from shardrec.rank_runtime.formats.channel import Channel
from shardrec.rank_runtime.pipeline import exchanges
from shardrec.rank_runtime.process import lifecycle
from shardrec.rank_runtime.process.world import get_world
from mx_rec.optimizers import gradient_descent

PAD = 0  # the padding id: looked up, counted and trained like a real id, as a padded feature's is


def bags(rank, batch, steps, mean):
    rng = np.random.default_rng(1000 + rank)
    lengths = rng.integers(1, 2 * mean, size=batch * steps)
    ids = (rng.zipf(1.1, size=lengths.sum()) % (2**40) + 1).astype(np.int64)
    return ids, np.concatenate([[0], np.cumsum(lengths)])


def dataset(mode, ids, splits, batch):
    """Whole batches sliced from one [batches, (examples), (ids)] tensor: no per-example work in
    tf.data, which would cost more than the step and hide what is measured."""
    examples = tf.RaggedTensor.from_row_splits(ids, splits)
    batches = tf.RaggedTensor.from_uniform_row_length(examples, batch)
    data = tf.data.Dataset.from_tensor_slices(batches)
    if mode == "pooled":
        return data.map(lambda rt: {"ids": rt})
    # padded_batch's result: each batch padded to its longest example.
    return data.map(lambda rt: {"ids": rt.to_tensor(PAD)})


def build(mode, ids, splits, batch, dim, vocabulary):
    tf.compat.v1.reset_default_graph()
    init()
    spec = FeatureSpec("ids", table_name="emb")
    # Exactly the batches to run, so that every rank's pass ends at the same batch (a rank whose key
    # pipeline ran ahead into an endless dataset would still be in a round when its peer moves on).
    data = dataset(mode, ids, splits, batch).map(get_asc_insert_func([spec])).prefetch(2)
    element = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
    table = create_table(tf.int64, dim, "emb", tf.compat.v1.random_uniform_initializer(-0.05, 0.05, seed=1),
                         device_vocabulary_size=vocabulary)
    if mode == "pooled":
        emb = sparse_lookup(table, spec, batch=element, combiner="sum")
    else:
        rows = sparse_lookup(table, spec, batch=element)
        mask = tf.cast(tf.not_equal(element["ids"], PAD), tf.float32)[:, :, None]
        emb = tf.reduce_sum(rows * mask, axis=1)
    loss = tf.reduce_mean(tf.square(tf.reduce_sum(emb, 1) - 1.0))
    _, sparse = get_dense_and_sparse_variable()
    train = gradient_descent.create_hash_optimizer(0.01).apply_gradients(zip(tf.gradients(loss, sparse), sparse))
    start_asc_pipeline()
    return train


def measure(mode, ids, splits, batch, dim, steps, warmup, vocabulary):
    train = build(mode, ids, splits, batch, dim, vocabulary)
    names = [n for e in exchanges.of_graph().names() for n in (e.rows, e.gradients)]
    exchange = get_world().exchanges[Channel.TRAIN]
    before = exchange.counters()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in range(warmup):
            sess.run(train)
        sent0 = _bytes(names)
        cpu0, wall0 = _cpu(), time.perf_counter()
        for _ in range(steps):
            sess.run(train)
        cpu, wall = _cpu() - cpu0, time.perf_counter() - wall0
        sent = _bytes(names) - sent0
        try:  # the end of the pass, on every rank together
            sess.run(train)
            raise RuntimeError("bench/pooled.py: the dataset holds more batches than warmup + steps")
        except tf.errors.OutOfRangeError:
            pass
    # The key pipeline runs ahead of the steps: its bytes per batch over the whole pass.
    after = exchange.counters()
    pool = (after.pool_bytes_sent - before.pool_bytes_sent) / (after.batches - before.batches)
    lifecycle.terminate_config_initializer()
    return {"rows_bytes": sent / steps, "id_bytes": pool, "cpu_ms": 1e3 * cpu / steps,
            "wall_ms": 1e3 * wall / steps}


def one_row_per_id_bytes(ids, splits, batch, batches, dim, rank, ranks):
    """Per step, what a padded lookup without dedup would send this rank's peers: a row out and a
    gradient back per padded id owned elsewhere (the issue's reference for pooling's saving)."""
    total = 0
    for b in range(batches):
        lengths = np.diff(splits[b * batch:(b + 1) * batch + 1])
        flat = ids[splits[b * batch]:splits[(b + 1) * batch]]
        elsewhere = np.count_nonzero(flat % ranks != rank) + (lengths.max() * batch - len(flat)) * (PAD % ranks != rank)
        total += 2 * elsewhere * dim * 4
    return total / batches


def _bytes(names):
    return sum(native_ops.exchange_bytes_sent(n) for n in names)


def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bags", default="1,4,16,64")
    p.add_argument("--dims", default="16,128")
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    tf.compat.v1.disable_eager_execution()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    ranks = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    for mean in map(int, a.bags.split(",")):
        ids, splits = bags(rank, a.batch, a.steps + a.warmup, mean)
        # Room for every key of every rank's data, and the padding id: the same on every rank.
        vocabulary = int(1.1 * len(np.unique(np.concatenate([bags(r, a.batch, a.steps + a.warmup, mean)[0]
                                                            for r in range(ranks)])))) + 1024
        for dim in map(int, a.dims.split(",")):
            runs = {"pooled": [], "padded": []}
            for _ in range(a.rounds):
                for mode in runs:
                    runs[mode].append(measure(mode, ids, splits, a.batch, dim, a.steps, a.warmup, vocabulary))
            if rank == 0:
                med = {m: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for m, rs in runs.items()}
                print(json.dumps({"bag_mean": mean, "dim": dim, "ranks": ranks, "batch": a.batch,
                                  "ids_per_batch": int(splits[a.batch]), **med,
                                  "one_row_per_id_bytes": one_row_per_id_bytes(ids, splits, a.batch,
                                                                                a.steps + a.warmup, dim, rank, ranks),
                                  "wire_ratio": (med["pooled"]["rows_bytes"] + med["pooled"]["id_bytes"]) /
                                  max(med["padded"]["rows_bytes"], 1),
                                  "cpu_ratio": med["pooled"]["cpu_ms"] / med["padded"]["cpu_ms"]}), flush=True)


if __name__ == "__main__":
    main()
