"""The same ids as one table or spread over T tables: CPU time per id and wall time per step.

    python bench/table_groups.py --compare 1,26 [--ranks 1|2] [--rounds 3] [--fields 26] [--batch 4096]
                                 [--groups on,off] [--optimizer lazy_adam] [--dim 16]
    python bench/table_groups.py --tables 26 ...       (one configuration, in this process; one JSON line)

Every configuration trains the same batches (Zipf(1.1) keys, numpy's unbounded law, `--fields` ids
a sample, batches handed over from numpy with no parsing) with lazy Adam (or SGD) at dim 16. With T
tables, table t gets columns [t F/T, (t+1) F/T) of each batch as one feature of its own; one table
gets all F columns as one feature, each column's keys moved into a key range of its own (+ t 2^41),
so both see the same ids and the same distinct (table, key) pairs. `--compare` runs each pair of
(tables, grouping) in a process of its own, one after the other, `--rounds` times, each pinned to
its own cores (`taskset -c 1` at one rank; `mpiexec --bind-to core` at two), with one TensorFlow
thread per pool, and prints each figure's median and spread and its ratio to the first
configuration of the same round, then one JSON line. Grouping is switched by the environment
(SHARDREC_TABLE_GROUPS=off), as a user compares it. Also printed: the graph's build and the time from
there to the end of the first step (session, initializers, pipeline start), for wide models
(`--compare 1000 --fields 1000 --batch 64`).
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from scaling import ENV, MPIEXEC, run as json_line  # noqa: E402
from workload import aligned, rank_to_key  # noqa: E402

LR = 0.01


def batches(num, batch, fields, seed):
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(1.1, size=(num, batch, fields)) - 1, 2**39)
    return rank_to_key(ranks)


def per_table(keys, tables):
    """Each table's feature arrays [num, batch, fields / tables], 64-byte aligned; one table: all
    columns, column c's keys moved by c 2^41 so that no two columns share a key."""
    num, batch, fields = keys.shape
    if tables == 1:
        return [aligned(keys + (np.arange(fields, dtype=np.int64) << 41)[None, None, :])]
    width = fields // tables
    return [aligned(np.ascontiguousarray(keys[:, :, t * width:(t + 1) * width])) for t in range(tables)]


def build(arrays, dim, optimizer, capacity):
    import tensorflow as tf
    from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable,
                                       sparse_lookup)
    from shardrec.rank_runtime.optimizers import gradient_descent, lazy_adam

    def batch_at(i):
        return [a[i % len(a)] for a in arrays]

    def element(i):
        ids = tf.numpy_function(batch_at, [i], [tf.int64] * len(arrays), stateful=False)
        return {f"f{t}": tf.ensure_shape(x, a.shape[1:]) for t, (x, a) in enumerate(zip(ids, arrays))}

    specs = [FeatureSpec(f"f{t}", table_name=f"t{t}") for t in range(len(arrays))]
    dataset = tf.data.Dataset.range(2**62).map(element).prefetch(1)
    dataset = dataset.map(get_asc_insert_func(specs, is_training=True)).prefetch(4)
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    init = tf.compat.v1.truncated_normal_initializer(stddev=0.05, seed=1)
    embs = [sparse_lookup(create_table(tf.int64, dim, f"t{t}", init, device_vocabulary_size=capacity), spec,
                          batch=batch) for t, spec in enumerate(specs)]
    loss = tf.add_n([tf.reduce_sum(tf.square(e)) for e in embs])
    _, sparse = get_dense_and_sparse_variable()
    opt = gradient_descent.create_hash_optimizer(LR) if optimizer == "sgd" else lazy_adam.create_hash_optimizer(LR)
    return opt.apply_gradients(zip(tf.gradients(loss, sparse), sparse))


def one(args):
    import tensorflow as tf
    from shardrec.rank_runtime import get_rank_id, get_rank_size, init, start_asc_pipeline

    tf.compat.v1.disable_eager_execution()
    init(use_dynamic=True)
    rank, size = get_rank_id(), get_rank_size()
    keys = batches(args.batches, args.batch, args.fields, seed=1000 * rank + 7)
    arrays = per_table(keys, args.tables)
    # Room for every rank's keys of the table that sees the most (a global vocabulary).
    capacity = max(len(np.unique(a)) for a in arrays) * size * 2 + 1024
    start = time.perf_counter()
    op = build(arrays, args.dim, args.optimizer, capacity)
    built = time.perf_counter()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        start_asc_pipeline()
        sess.run(op)
        first_step = time.perf_counter() - built
        for _ in range(args.warmup):
            sess.run(op)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(args.steps):
            sess.run(op)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    ids = args.steps * args.batch * args.fields
    out = {"tables": args.tables, "ranks": size, "groups": os.environ.get("SHARDREC_TABLE_GROUPS", "on"),
           "cpu_ns_per_id": cpu * 1e9 / ids, "wall_ms_per_step": wall * 1e3 / args.steps,
           "build_s": built - start, "first_step_s": first_step}
    if size > 1:
        from mpi4py import MPI

        every = MPI.COMM_WORLD.allgather(out)
        out = dict(out, cpu_ns_per_id=sum(o["cpu_ns_per_id"] for o in every) / size,
                   wall_ms_per_step=max(o["wall_ms_per_step"] for o in every))
    if rank == 0:
        print(json.dumps(out), flush=True)


def compare(args, p):
    tables = [int(t) for t in args.compare.split(",")]
    groups = args.groups.split(",")
    configs = [(t, g) for t in tables for g in groups]
    passed = _without(sys.argv[1:], ("--compare", "--rounds", "--groups", "--ranks"))
    results = {c: [] for c in configs}
    for r in range(args.rounds):
        for t, g in configs:
            env = dict(ENV, SHARDREC_TABLE_GROUPS=g)
            if args.ranks == 1:
                cmd = ["taskset", "-c", "1", sys.executable, __file__, "--tables", str(t)] + passed
            else:
                cmd = [MPIEXEC, "--oversubscribe", "--bind-to", "core", "--map-by", "core", "-np", str(args.ranks),
                       sys.executable, __file__, "--tables", str(t)] + passed
            results[(t, g)].append(json_line(cmd, env=env))
            print(f"round {r + 1}: {t} tables, groups {g}: {results[(t, g)][-1]}", file=sys.stderr, flush=True)
    base = configs[0]
    summary = []
    for c in configs:
        row = {"tables": c[0], "groups": c[1]}
        for k in ("cpu_ns_per_id", "wall_ms_per_step", "build_s", "first_step_s"):
            values = [o[k] for o in results[c]]
            ratios = [o[k] / b[k] for o, b in zip(results[c], results[base])]
            row[k] = statistics.median(values)
            row[k + "_spread"] = [min(values), max(values)]
            row[k + "_ratio"] = statistics.median(ratios)
        summary.append(row)
        print(f"{c[0]:>5} tables  groups {c[1]:<3}  CPU {row['cpu_ns_per_id']:7.1f} ns/id "
              f"({row['cpu_ns_per_id_spread'][0]:.0f}-{row['cpu_ns_per_id_spread'][1]:.0f}) "
              f"x{row['cpu_ns_per_id_ratio']:.2f}   wall {row['wall_ms_per_step']:7.1f} ms/step "
              f"x{row['wall_ms_per_step_ratio']:.2f}   build {row['build_s']:.1f} s, "
              f"first step {row['first_step_s']:.1f} s")
    print(json.dumps({"ranks": args.ranks, "rounds": args.rounds, "rows": summary}))


def _without(argv, options):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not any(a.startswith(o + "=") for o in options):
            out.append(a)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", help="table counts to alternate, e.g. 1,26")
    p.add_argument("--groups", default="on,off", help="with --compare: SHARDREC_TABLE_GROUPS values to alternate")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--tables", type=int, default=1)
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--batches", type=int, default=20, help="distinct batches drawn (cycled)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--optimizer", choices=["lazy_adam", "sgd"], default="lazy_adam")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    if args.fields % args.tables:
        p.error(f"--fields {args.fields} must be a multiple of --tables {args.tables}")
    if args.compare:
        compare(args, p)
    else:
        one(args)


if __name__ == "__main__":
    main()
