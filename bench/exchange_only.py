"""The native key exchange alone, without TensorFlow: weak scaling over ranks and batch-time tails.

    mpiexec -np N [--bind-to core] python bench/exchange_only.py [--batch 4096] [--features 26]
        [--distinct 10000000] [--batches 60] [--passes 3]

Every rank exchanges its own batches of `features` x `batch` ids (Zipf over `distinct` keys, a
seed per rank) through one table, as the key pipeline does for one training step. The first pass
inserts most keys (the table grows), the later ones look known keys up. Rank 0 prints one JSON
line: per-rank ids/s (the slowest rank's time per batch), batch-time median and 99th percentile
over all passes and over the inserting pass, and the seconds inside MPI. Needs numpy, mpi4py and
shardrec.native.core only, so it also runs where TensorFlow is not installed.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import workload  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--features", type=int, default=26)
    p.add_argument("--distinct", type=int, default=10_000_000)
    p.add_argument("--batches", type=int, default=60, help="distinct batches per rank, cycled")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)

    from mpi4py import MPI

    from shardrec.native import core

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    keys, _, seen = workload.make_batches(args.batches, args.batch, args.features, args.distinct, seed=rank)
    # One table of the whole key set's size, split over the ranks as create_table does.
    capacity = int(np.ceil(args.distinct / size))
    index = core.EmbeddingIndex("bench", capacity)
    names = [f"f{i:02d}" for i in range(args.features)]
    features = core.FeatureSet(names, [index] * args.features, [0] * args.features, [False] * args.features,
                               "\n".join(names))
    exchange = core.KeyExchange(comm.Dup(), core.Channel.TRAIN, args.timeout)
    batches = [[np.ascontiguousarray(b[:, f]) for f in range(args.features)] for b in keys]
    times = np.zeros((args.passes, args.batches))
    comm.Barrier()
    for p_ in range(args.passes):
        for b, batch in enumerate(batches):
            start = time.perf_counter()
            exchange.run(features, batch, True)
            times[p_, b] = time.perf_counter() - start
    counters = exchange.counters()
    # The job moves at the pace of its slowest rank: per batch, the longest time of any rank.
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    held = comm.allreduce(index.size())
    if rank == 0:
        ids = args.batch * args.features
        steady = slowest[1:] if args.passes > 1 else slowest
        print(json.dumps({
            "ranks": size, "ids_per_batch_per_rank": ids, "distinct": args.distinct, "keys_held": held,
            "ids_per_s_per_rank": ids / float(np.median(steady)),
            "median_ms": 1e3 * float(np.median(slowest)), "p99_ms": 1e3 * float(np.percentile(slowest, 99)),
            "insert_pass_median_ms": 1e3 * float(np.median(slowest[0])),
            "insert_pass_p99_ms": 1e3 * float(np.percentile(slowest[0], 99)),
            "steady_median_ms": 1e3 * float(np.median(steady)),
            "rank0_seconds_in_mpi": counters.seconds_in_collectives, "rank0_seconds_total": counters.seconds_total,
        }), flush=True)


if __name__ == "__main__":
    main()
