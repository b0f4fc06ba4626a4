"""Sparse step throughput: ids/s of lookup + forward + backward + update, one peer per process.

    python bench/sparse_step.py --peer shardrec --dim 16 --optimizer lazy_adam [--batches 40] [--faae]
                                [--feed records|parquet|step-only]
    python bench/sparse_step.py --peer shardrec --memory-fraction 0.1 [--ssd-path DIR]   (an SSD tier)
    mpiexec -np 2 python bench/sparse_step.py --peer shardrec --sharding column_wise ...  (a placement)
    mpiexec -np 2 python bench/sparse_step.py --peer shardrec ...     (aggregate over the ranks)

The default feed is a user's (workload.py): TFRecord files of tf.train.Example read by tf.data,
batched and parsed, for every peer alike; --feed parquet reads the same samples from Parquet
files with ParquetDataset (no parsing: columns straight into tensors); --feed step-only hands each step its batch from numpy
(the step with nothing around it). Prints one JSON line: {"peer", "dim", "optimizer", "ranks",
"feed", "ids_per_s" (median of windows), "windows", "distinct_per_batch", ...}.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
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
    p.add_argument("--distinct", type=int, default=0,
                   help="keys the Zipf law is truncated to (0, default: numpy's unbounded Zipf(1.1))")
    p.add_argument("--feed", choices=["records", "parquet", "step-only"], default="records",
                   help="records (default): TFRecord files parsed by tf.data, a user's path; parquet: the same "
                        "samples as Parquet files read by ParquetDataset; step-only: batches from numpy, no parsing")
    p.add_argument("--batches", type=int, default=40, help="distinct batches, cycled")
    p.add_argument("--seed", type=int, default=None,
                   help="draw the batches rank SEED draws (default: this rank's; bench/scaling.py --together)")
    p.add_argument("--keys-file", default=None,
                   help="an .npy of [batches, batch, fields] int64 keys to train on instead of drawing them (the "
                        "single-core loop's keys, bench/limit.py); rank r starts at batch r x batches / ranks")
    p.add_argument("--steps", type=int, default=32, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--faae", action="store_true",
                   help="shardrec: admission (threshold 2) and eviction (peers.shardrec)")
    p.add_argument("--evict-every", type=int, default=100, help="with --faae: steps between evictions (0: none)")
    p.add_argument("--prefetch", type=int, default=4, help="shardrec: batches the key pipeline runs ahead")
    p.add_argument("--sharding", default=None, help="shardrec: the table's create_table(sharding=): row_wise "
                   "(default), replicated, table_wise or column_wise (over every rank)")
    p.add_argument("--memory-fraction", type=float, default=0.0,
                   help="shardrec: an SSD tier, with this fraction of the keys in memory (0: every key in memory)")
    p.add_argument("--ssd-path", default=None, help="with --memory-fraction: where the SSD files go (default: /tmp)")
    p.add_argument("--trace-steps", type=int, default=0,
                   help="shardrec: traced steps after the timed ones, for the row all-to-all's share of a step")
    p.add_argument("--track-changes", choices=["off", "on", "alternate"], default="off",
                   help="shardrec: flag every updated row for incremental checkpoints, as init(is_incremental_checkpoint="
                        "True) does; alternate: off and on in turns, window by window, each mode's median reported "
                        "(bench/incremental.py)")
    p.add_argument("--timeline", type=int, default=0, metavar="N",
                   help="shardrec: N traced steps after the timed ones, split into compute, waits for each exchange, "
                        "moving rows and the key pipeline (rank_runtime/pipeline/step_profile.py); printed by rank 0")
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
    seed = rank if args.seed is None else args.seed
    if args.keys_file:
        if args.seed is not None:
            p.error("--seed draws batches; --keys-file reads them")
        keys, rows, seen = workload.load_batches(args.keys_file, rank, size)
        args.batch, args.fields = keys.shape[1:]
    else:
        keys, rows, seen = workload.make_batches(args.batches, args.batch, args.fields, args.distinct, seed=seed)
    if args.feed == "records":
        features = set(peers.FEATURES.get(args.peer, ("ids",))) | ({"ts"} if args.faae else set())
        dataset = workload.record_dataset(workload.write_records(keys, rows, seed), args.batch, args.fields, features)
    elif args.feed == "parquet":
        features = set(peers.FEATURES.get(args.peer, ("ids",))) | ({"ts"} if args.faae else set())
        dataset = workload.parquet_dataset(workload.write_parquet(keys, rows, seed), args.batch, args.fields, features,
                                           shardrec_training=args.peer == "shardrec")
    else:
        dataset = workload.batch_dataset(keys, rows)
    # A global vocabulary: the ranks draw different batches, so their key sets differ.
    capacity = int(seen * size * 1.05) + 16
    if (args.faae or args.memory_fraction or args.sharding) and args.peer != "shardrec":
        p.error("--faae, --memory-fraction and --sharding are shardrec's")
    extra = {"faae": True, "evict_every": args.evict_every} if args.faae else {}
    ssd_dir = None
    if args.peer == "shardrec":
        extra["prefetch"] = args.prefetch
        if args.sharding:
            extra["sharding"] = args.sharding
        if args.memory_fraction:
            ssd_dir = tempfile.mkdtemp(prefix="shardrec-bench-ssd-", dir=args.ssd_path)
            extra.update(memory_fraction=args.memory_fraction, ssd_path=ssd_dir)
    op, setup = peers.PEERS[args.peer](dataset, args.dim, args.optimizer, capacity, **extra)
    tracked = None
    if args.track_changes != "off":
        from shardrec.rank_runtime.process import config

        tracked = config.get_table("emb").index
        tracked.track_changes(True)
    shares = {}
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        step = setup(sess) or (lambda: sess.run(op))
        for _ in range(args.warmup):
            step()
        per_window = max(1, args.steps // args.windows)
        rates, by_mode, cpu_per_id = [], {False: [], True: []}, []
        tiers_before = _tier_counters(args)
        exchange_before, timed_start, cpu_start = _exchange_counters(args.peer), time.perf_counter(), time.process_time()
        for window in range(args.windows):
            tracking = args.track_changes == "on" or (args.track_changes == "alternate" and window % 2 == 1)
            if tracked is not None:
                tracked.track_changes(tracking)
            start, cpu_window = time.perf_counter(), time.process_time()
            for _ in range(per_window):
                step()
            rates.append(per_window * args.batch * args.fields * size / (time.perf_counter() - start))
            cpu_per_id.append((time.process_time() - cpu_window) * 1e9 / (per_window * args.batch * args.fields))
            by_mode[tracking].append(rates[-1])
        if args.track_changes == "alternate":
            shares["tracking_ratio"] = float(np.median(by_mode[True]) / np.median(by_mode[False]))
            shares["windows_by_mode"] = {"off": by_mode[False], "on": by_mode[True]}
        if args.peer == "shardrec":
            # The key exchange runs in the dataset's thread, ahead of the steps (prefetch): its share
            # of the timed wall time, and the part of it spent waiting in MPI.
            wall, after = time.perf_counter() - timed_start, _exchange_counters(args.peer)
            cpu = time.process_time() - cpu_start
            shares["key_exchange_share"] = (after.seconds_total - exchange_before.seconds_total) / wall
            shares["key_collectives_share"] = (after.seconds_in_collectives -
                                               exchange_before.seconds_in_collectives) / wall
            if tiers_before:
                shares["tiers"] = _tier_summary(tiers_before, _tier_counters(args), per_window * args.windows, wall)
        if args.timeline:
            from shardrec.rank_runtime.pipeline.step_profile import StepTimeline

            timeline = StepTimeline()
            for _ in range(args.timeline):
                timeline.run(sess, op)
            steps = per_window * args.windows
            report = timeline.report(exchange_before, after, wall / steps, cpu / steps)
            shares["timeline"] = list(report.ranks)
            if rank == 0:
                print(report.format(), file=sys.stderr, flush=True)
        if args.trace_steps:
            from shardrec.rank_runtime.pipeline.step_profile import row_exchange_share, traced_run_options

            traced = []
            for _ in range(args.trace_steps):
                metadata = tf.compat.v1.RunMetadata()
                sess.run(op, options=traced_run_options(), run_metadata=metadata)
                traced.append(row_exchange_share(metadata, tf.compat.v1.get_default_graph()))
            shares["row_exchange_share"] = float(np.median(traced))
        # Inside the session: a rank whose session closed first would leave a peer's prefetch
        # waiting in a key exchange round that this gather then never lets it finish.
        shares["cpu_ns_per_id"] = _across_ranks(float(np.median(cpu_per_id)), size)
    shares["cpu_ns_per_id_windows"] = cpu_per_id
    if rank == 0:
        if args.faae:
            from shardrec.rank_runtime.process import config

            shares["table_counters"] = {k: v for k, v in config.get_table("emb").counters().as_dict().items()
                                        if k in ("admitted", "rejected", "evicted", "reused", "size", "pending")}
        if ssd_dir:
            shares["memory_fraction"] = args.memory_fraction
            shares["swap_policy"] = os.environ.get("SHARDREC_SWAP_POLICY", "default")
        print(json.dumps({"peer": args.peer, "dim": args.dim, "optimizer": args.optimizer, "ranks": size,
                          "feed": args.feed, "ids_per_s": float(np.median(rates)), "windows": rates,
                          "distinct_seen": seen, "distinct_per_batch": workload.distinct_per_batch(keys), **shares}),
              flush=True)
    if ssd_dir:
        from shardrec.rank_runtime.process import config

        config.get_table("emb").ssd.close()
        _remove(ssd_dir)


def _across_ranks(value, size):
    """Every rank's `value`, in rank order (the process's CPU time: every thread of the rank, the key
    pipeline's included)."""
    if size == 1:
        return [value]
    from mpi4py import MPI

    return MPI.COMM_WORLD.allgather(value)


def _remove(directory):
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def _tier_counters(args):
    if args.peer != "shardrec" or not args.memory_fraction:
        return {}
    from shardrec.rank_runtime.process import config

    return config.get_table("emb").counters().as_dict()


def _tier_summary(before, after, steps, wall):
    """The timed steps' share of lookups served from memory, and rows and bytes moved per step."""
    d = {k: after[k] - before[k] for k in ("memory_hits", "ssd_hits", "misses", "swapped_in", "swapped_out",
                                           "bytes_swapped_in", "bytes_swapped_out")}
    looked_up = d["memory_hits"] + d["ssd_hits"]
    return {"memory_hit_ratio": d["memory_hits"] / looked_up if looked_up else 1.0,
            "rows_in_per_step": d["swapped_in"] / steps, "rows_out_per_step": d["swapped_out"] / steps,
            "ssd_bytes_read_per_step": d["bytes_swapped_in"] / steps,
            "ssd_bytes_written_per_step": d["bytes_swapped_out"] / steps,
            "ssd_read_mb_per_s": d["bytes_swapped_in"] / wall / 1e6, "rows_on_ssd": after["rows_on_ssd"],
            "rows_in_memory": after["rows_in_memory"], "memory_rows": after["capacity"]}


def _exchange_counters(peer):
    if peer != "shardrec":
        return {}
    from shardrec.rank_runtime.formats.channel import Channel
    from shardrec.rank_runtime.process.world import get_world

    return get_world().exchanges[Channel.TRAIN].counters()


if __name__ == "__main__":
    main()
