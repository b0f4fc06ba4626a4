"""Many tables of mixed dims, placements and optimizers, trained over fixed global batches (each
rank its slice of each) with table groups on or off (tests/test_table_groups.py): both must give
the same rows bit for bit, and plain TensorFlow's on the global batches.

    mpiexec -np N python group_oracle.py OUT TAG on|off [--stall-rank R [--stall-step S]] [--drop-on-last T]

TABLES: (name, dim, sharding, optimizer, how it is looked up). "frozen" is looked up with
is_grad=False, "unused" is a feature of the dataset that no lookup reads: neither may move. Writes
OUT/TAG-rank<r>-of<N>.npz: per table its keys and rows, the dense weights, the steps run, and the
groups formed and the row exchanges of a step (forward, backward). --stall-rank R: rank R freezes (SIGSTOP) before step S (its key pipeline has
prefetched that batch); its peers wait in the step's grouped row exchange. --drop-on-last T: the last rank has no table T (nor its feature). --only a,b,d:
those tables alone. --expansion variables|by_address: dynamic expansion (row-wise and table-wise
tables), gradients taken of the table variables, or of the lookups' rows by address and applied at
their addresses (the by-address optimizers).
"""
import argparse
import os
import signal

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from mx_rec.constants.constants import ASCEND_SPARSE_LOOKUP_ID_OFFSET, ASCEND_SPARSE_LOOKUP_LOCAL_EMB
from mx_rec.optimizers import gradient_descent, gradient_descent_by_addr, lazy_adam, lazy_adam_by_addr
from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable,
                                   get_rank_id, get_rank_size, init, sparse_lookup, start_asc_pipeline,
                                   terminate_config_initializer)
from shardrec.rank_runtime.pipeline import table_groups

GLOBAL_BATCH, STEPS, FIELDS, DENSE = 12, 20, 2, 3
TABLES = (("a", 4, "row_wise", "sgd", "grad"), ("b", 4, "row_wise", "lazy_adam", "grad"),
          ("c", 4, "table_wise", "sgd", "grad"), ("d", 8, "row_wise", "lazy_adam", "grad"),
          ("e", 8, "row_wise", "sgd", "grad"), ("f", 4, "replicated", "lazy_adam", "grad"),
          ("g", 8, "column_wise", "sgd", "grad"), ("h", 4, "row_wise", "lazy_adam", "frozen"),
          ("i", 8, "table_wise", "lazy_adam", "grad"), ("z", 4, "row_wise", "sgd", "unused"))
LEARNING_RATES = {"sgd": 0.1, "lazy_adam": 0.02}


def global_data():
    rng = np.random.default_rng(71)
    out = {}
    for i, (name, *_) in enumerate(TABLES):
        pool = np.concatenate([rng.integers(-(2**40), 2**40, size=20), np.arange(-4, 4) * (i + 1)])
        out[name] = pool[np.minimum(rng.geometric(0.1, size=(STEPS * GLOBAL_BATCH, FIELDS)) - 1,
                                    len(pool) - 1)].astype(np.int64)
    out["x"] = rng.normal(size=(STEPS * GLOBAL_BATCH, DENSE)).astype(np.float32)
    out["y"] = rng.normal(size=STEPS * GLOBAL_BATCH).astype(np.float32)
    return out


def model(batch, embs):
    """(loss, w): a linear model over every looked-up table's rows and the dense features."""
    flat = [tf.reshape(e, [-1, FIELDS * int(e.shape[-1])]) for e in embs]
    width = sum(int(f.shape[1]) for f in flat) + DENSE
    w = tf.compat.v1.get_variable("w", [width, 1], initializer=tf.compat.v1.glorot_uniform_initializer(seed=7))
    pred = tf.squeeze(tf.matmul(tf.concat(flat + [batch["x"]], 1), w), 1)
    return tf.reduce_mean(tf.square(pred - batch["y"])), w


def placement(kind, size):
    if kind == "table_wise":
        return {"sharding": kind, "sharding_rank": size - 1}
    if kind == "column_wise":
        return {"sharding": kind, "sharding_rank": list(range(max(0, size - 2), size))}
    return {"sharding": kind}


def sparse_updates(loss, tables, kept, by_address):
    """One optimizer per kind over its tables' variables, or, by address, over the lookups' rows."""
    if by_address:
        rows = tf.compat.v1.get_collection(ASCEND_SPARSE_LOOKUP_LOCAL_EMB)
        addresses = tf.compat.v1.get_collection(ASCEND_SPARSE_LOOKUP_ID_OFFSET)
        kind = {name: opt for name, _, _, opt, _ in kept}
        opt_of = [next(kind[n] for n, t in tables.items() if t.local_rows_at(a) is not None) for a in addresses]
        make = {"sgd": gradient_descent_by_addr.create_hash_optimizer_by_addr,
                "lazy_adam": lazy_adam_by_addr.create_hash_optimizer_by_address}
        grads = tf.gradients(loss, rows)
        return [make[opt](LEARNING_RATES[opt]).apply_gradients(
                    [(g, a) for g, a, o in zip(grads, addresses, opt_of) if o == opt])
                for opt in sorted(set(opt_of))]
    by_opt = {}
    for name, _, _, opt, _ in kept:  # "frozen" and "unused" too: their gradient must be None
        by_opt.setdefault(opt, []).append(tables[name].variable)
    make = {"sgd": gradient_descent.create_hash_optimizer, "lazy_adam": lazy_adam.create_hash_optimizer}
    return [make[opt](LEARNING_RATES[opt]).apply_gradients(zip(tf.gradients(loss, vs), vs))
            for opt, vs in sorted(by_opt.items())]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("tag")
    p.add_argument("groups", choices=["on", "off"])
    p.add_argument("--stall-rank", type=int)
    p.add_argument("--stall-step", type=int, default=3)
    p.add_argument("--drop-on-last")
    p.add_argument("--only", help="these tables alone (a,b,d)")
    p.add_argument("--expansion", choices=["variables", "by_address"])
    args = p.parse_args()
    tf.compat.v1.disable_eager_execution()
    init(table_groups=args.groups == "on", use_dynamic_expansion=args.expansion is not None)
    rank, size = get_rank_id(), get_rank_size()
    chosen = [t for t in TABLES if args.only is None or t[0] in args.only.split(",")]
    kept = [t for t in chosen if not (rank == size - 1 and t[0] == args.drop_on_last)]
    local = GLOBAL_BATCH // size
    data = global_data()
    rows = np.concatenate([np.arange(s * GLOBAL_BATCH + rank * local, s * GLOBAL_BATCH + (rank + 1) * local)
                           for s in range(STEPS)])
    data = {k: v[rows] for k, v in data.items()}
    specs = [FeatureSpec(name, table_name=name) for name, *_ in kept]
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(local, drop_remainder=True)
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset.map(get_asc_insert_func(specs, is_training=True)))
    batch = iterator.get_next()
    # Each table is created and looked up in turn, as models do: a group's lookups are known only
    # when the gradient is taken.
    specs_of, tables, embs = {spec.name: spec for spec in specs}, {}, []
    for name, dim, kind, _, use in chosen:
        if name in specs_of:
            tables[name] = create_table(tf.int64, dim, name, tf.compat.v1.constant_initializer(0.1),
                                        device_vocabulary_size=100,
                                        all2all_gradients_op="sum_gradients_and_div_by_ranksize",
                                        **placement(kind, size))
        if use == "unused":
            continue
        # A dropped table reads zeros, so that the dense model keeps its shape on every rank.
        embs.append(sparse_lookup(tables[name], specs_of[name], batch=batch, is_grad=use == "grad")
                    if name in tables else tf.zeros([local, FIELDS, dim]))
    loss, w = model(batch, embs)
    dense, _ = get_dense_and_sparse_variable()
    sparse_ops = sparse_updates(loss, tables, kept, args.expansion == "by_address")
    train_op = tf.group(
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05)).minimize(loss, var_list=dense),
        *sparse_ops)
    start_asc_pipeline()
    steps = 0
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_variables(dense, root_rank=0))
        sess.run(iterator.initializer)
        while True:
            if args.stall_rank == rank and steps == args.stall_step:
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen until the job's end kills it
            try:
                sess.run(train_op)
                steps += 1
            except tf.errors.OutOfRangeError:
                break
        ops = tf.compat.v1.get_default_graph().get_operations()
        alltoalls = [o.name.startswith("gradients") for o in ops if o.type == "ShardrecRowAlltoall"]
        out = {"w": sess.run(w), "steps": steps, "alltoalls": np.array([alltoalls.count(False), alltoalls.count(True)]),
               "groups": np.array([",".join(t.table_name for t in g.tables)
                                   for g in table_groups.groups_of(tf.compat.v1.get_default_graph()) if g.fused])}
        for name, table in tables.items():
            out.update({f"{name}.{column}": np.asarray(values, np.float32) if column != "keys" else values
                        for column, values in table.export(sess).items()})
            out[f"{name}.placement"] = table.placement.describe()
    np.savez(os.path.join(args.out, f"{args.tag}-rank{rank}-of{size}.npz"), **out)
    terminate_config_initializer()


if __name__ == "__main__":
    main()
