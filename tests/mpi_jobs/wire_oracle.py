"""Tables that differ only in create_table(exchange_dtype=) and placement, trained with SGD on the
same ids under a linear loss whose gradients are exact in float32 (tests/test_sharding.py checks
every row and every looked-up value against a numpy reference that rounds what crosses).

    mpiexec -np 2 python wire_oracle.py OUT

Each rank looks up BATCH ids of a small pool (so keys repeat within a batch and between ranks) in
every table; loss = sum(emb * c), c a fixed multiple of 1/256 in [-4, 4] a position and column (its
sums are exact in float32 and most need more bits than a 16-bit float has). One more table, "pool",
takes BATCH examples of 0 to 3 weighted ids (weights multiples of 1/4), pooled on the owners with
combiner sum, its rows starting at 0.25: every product and sum stays exact in float32, so only the
16-bit rounding of what crosses decides its values. Writes OUT/wire-rank<r>.npz: the data, the
values looked up at every step, each table's keys and rows at the end, the bytes its exchanges sent.
"""
import os
import sys

import numpy as np
import tensorflow as tf

from mx_rec.optimizers import gradient_descent
from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable,
                                   get_rank_id, get_rank_size, init, sparse_lookup, start_asc_pipeline,
                                   terminate_config_initializer)
from shardrec.rank_runtime.embedding import native_ops
from shardrec.rank_runtime.pipeline import exchanges as graph_exchanges

BATCH, STEPS, DIM, POOL = 8, 6, 4, 12
LEARNING_RATE = 0.5
# name: (exchange_dtype, sharding, sharding_rank)
TABLES = {"f32": ("float32", "row_wise", None), "b16": ("bfloat16", "row_wise", None),
          "h16": ("float16", "row_wise", None), "b16_tw": ("bfloat16", "table_wise", 1),
          "b16_rep": ("bfloat16", "replicated", None)}


def data(rank):
    rng = np.random.default_rng(100 + rank)
    ids = rng.integers(0, POOL, size=(STEPS * BATCH, 1)).astype(np.int64)
    c = (rng.integers(-1024, 1025, size=(STEPS * BATCH, DIM)) / 256).astype(np.float32)
    lengths = rng.integers(0, 4, size=STEPS * BATCH)
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    pooled = rng.integers(0, POOL, size=splits[-1]).astype(np.int64)
    weights = (rng.integers(1, 9, size=splits[-1]) / 4).astype(np.float32)
    return ids, c, pooled, weights, splits


def main():
    out = sys.argv[1]
    tf.compat.v1.disable_eager_execution()
    init()
    rank, size = get_rank_id(), get_rank_size()
    ids, c, pooled, weights, splits = data(rank)
    specs = [FeatureSpec(name, table_name=name) for name in TABLES]
    pool_spec = FeatureSpec("pool", table_name="pool")
    ragged = {"pool": tf.RaggedTensor.from_row_splits(pooled, splits), "w": tf.RaggedTensor.from_row_splits(weights,
                                                                                                            splits)}
    batches = tf.data.Dataset.from_tensor_slices({**{n: ids for n in TABLES}, "c": c, **ragged}).ragged_batch(BATCH)
    iterator = tf.compat.v1.data.make_initializable_iterator(batches.map(get_asc_insert_func(specs + [pool_spec],
                                                                                             is_training=True)))
    batch = iterator.get_next()
    tables = [create_table(tf.int64, DIM, name, tf.compat.v1.constant_initializer(0.3), device_vocabulary_size=64,
                           exchange_dtype=wire, sharding=sharding, sharding_rank=at)
              for name, (wire, sharding, at) in TABLES.items()]
    tables.append(create_table(tf.int64, DIM, "pool", tf.compat.v1.constant_initializer(0.25),
                               device_vocabulary_size=64, exchange_dtype="bfloat16"))
    embs = [tf.reshape(sparse_lookup(t, s, batch=batch), [-1, DIM]) for t, s in zip(tables, specs)]
    embs.append(sparse_lookup(tables[-1], pool_spec, batch=batch, combiner="sum", weights=batch["w"]))
    loss = tf.add_n([tf.reduce_sum(e * batch["c"]) for e in embs])
    _, sparse = get_dense_and_sparse_variable()
    train_op = gradient_descent.create_hash_optimizer(LEARNING_RATE).apply_gradients(
        zip(tf.gradients(loss, sparse), sparse))
    # Each row exchange's wire dtype and width, for the check that a pooled lookup's weights (width 1)
    # cross as float32 (their values here are 16-bit exact, so the numbers alone would not tell).
    wires = [f"{op.name} {op.get_attr('wire').decode()} {op.inputs[0].shape[-1]}"
             for op in tf.compat.v1.get_default_graph().get_operations() if op.type == "ShardrecRowAlltoall"]
    start_asc_pipeline()
    looked_up = []
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(iterator.initializer)
        for _ in range(STEPS):
            looked_up.append(sess.run([train_op] + embs)[1:])
        result = {"ids": ids, "c": c, "pooled": pooled, "weights": weights, "splits": splits, "size": size,
                  "wires": np.array(wires)}
        for i, table in enumerate(tables):
            name = table.table_name
            result[f"{name}.emb"] = np.stack([step[i] for step in looked_up])
            exported = table.export(sess)
            result[f"{name}.keys"] = exported["keys"]
            result[f"{name}.rows"] = np.asarray(exported["values"], np.float32)
            exchanges = {e for e in graph_exchanges.of_graph().names() if e.table == name}
            result[f"{name}.bytes"] = sum(native_ops.exchange_bytes_sent(e.rows) + native_ops.exchange_bytes_sent(
                e.gradients) for e in exchanges)
    np.savez(os.path.join(out, f"wire-rank{rank}.npz"), **result)
    terminate_config_initializer()


if __name__ == "__main__":
    main()
