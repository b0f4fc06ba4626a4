"""Sparse step throughput: ids/s of lookup + forward + backward + update, one peer per process.

    python bench/sparse_step.py --peer shardrec --dim 16 --optimizer lazy_adam [--batches 40] [--faae]
    mpiexec -np 2 python bench/sparse_step.py --peer shardrec ...     (aggregate over the ranks)

Prints one JSON line: {"peer", "dim", "optimizer", "ranks", "ids_per_s" (median of windows), ...}.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
import workload  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--peer", choices=sorted(peers.PEERS), required=True)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--optimizer", choices=["sgd", "lazy_adam"], default="lazy_adam")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--distinct", type=int, default=10_000_000)
    p.add_argument("--batches", type=int, default=40, help="distinct batches, cycled")
    p.add_argument("--steps", type=int, default=32, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--faae", action="store_true",
                   help="shardrec: admission (threshold 2) and eviction (peers.shardrec)")
    p.add_argument("--evict-every", type=int, default=100, help="with --faae: steps between evictions (0: none)")
    p.add_argument("--trace-steps", type=int, default=0,
                   help="shardrec: traced steps after the timed ones, for the row all-to-all's share of a step")
    args = p.parse_args(argv)
    tf.compat.v1.disable_eager_execution()

    rank, size = 0, 1
    if args.peer == "shardrec":
        from shardrec.rank_runtime import get_rank_id, get_rank_size, init

        init()
        rank, size = get_rank_id(), get_rank_size()
    elif args.peer == "tfra_horovod":
        import horovod.tensorflow as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    keys, rows, seen = workload.make_batches(args.batches, args.batch, args.fields, args.distinct, seed=rank)
    dataset = workload.batch_dataset(keys, rows)
    # A global vocabulary: the ranks draw different batches, so their key sets differ.
    capacity = int(seen * size * 1.05) + 16
    if args.faae and args.peer != "shardrec":
        p.error("--faae is shardrec's")
    op, setup = peers.PEERS[args.peer](dataset, args.dim, args.optimizer, capacity,
                                       **({"faae": True, "evict_every": args.evict_every} if args.faae else {}))
    shares = {}
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        step = setup(sess) or (lambda: sess.run(op))
        for _ in range(args.warmup):
            step()
        per_window = max(1, args.steps // args.windows)
        rates = []
        exchange_before, timed_start = _exchange_counters(args.peer), time.perf_counter()
        for _ in range(args.windows):
            start = time.perf_counter()
            for _ in range(per_window):
                step()
            rates.append(per_window * args.batch * args.fields * size / (time.perf_counter() - start))
        if args.peer == "shardrec":
            # The key exchange runs in the dataset's thread, ahead of the steps (prefetch): its share
            # of the timed wall time, and the part of it spent waiting in MPI.
            wall, after = time.perf_counter() - timed_start, _exchange_counters(args.peer)
            shares["key_exchange_share"] = (after["seconds_total"] - exchange_before["seconds_total"]) / wall
            shares["key_collectives_share"] = (after["seconds_in_collectives"] -
                                               exchange_before["seconds_in_collectives"]) / wall
        if args.trace_steps:
            from shardrec.rank_runtime.step_profile import row_exchange_share, traced_run_options

            traced = []
            for _ in range(args.trace_steps):
                metadata = tf.compat.v1.RunMetadata()
                sess.run(op, options=traced_run_options(), run_metadata=metadata)
                traced.append(row_exchange_share(metadata, tf.compat.v1.get_default_graph()))
            shares["row_exchange_share"] = float(np.median(traced))
    if rank == 0:
        if args.faae:
            from shardrec.rank_runtime import config

            shares["table_counters"] = {k: v for k, v in config.get_table("emb").counters().items()
                                        if k in ("admitted", "rejected", "evicted", "reused", "size", "pending")}
        print(json.dumps({"peer": args.peer, "dim": args.dim, "optimizer": args.optimizer, "ranks": size,
                          "ids_per_s": float(np.median(rates)), "windows": rates, "distinct_seen": seen, **shares}),
              flush=True)


def _exchange_counters(peer):
    if peer != "shardrec":
        return {}
    from shardrec.rank_runtime.world import get_world

    return get_world().exchanges["train"].counters()


if __name__ == "__main__":
    main()
