"""Resident bytes per stored key: a dim-16 table with lazy Adam slots after training on batches
that insert N distinct keys. One peer per process; prints one JSON line.

    python bench/memory.py --peer shardrec --keys 5000000
"""
import argparse
import json
import os
import sys

import psutil
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
import workload  # noqa: E402

DIM = 16


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--peer", choices=["shardrec", "tfra"], required=True)
    p.add_argument("--keys", type=int, default=5_000_000)
    p.add_argument("--batch", type=int, default=50_000)
    p.add_argument("--capacity-factor", type=float, default=1.0,
                   help="table capacity (shardrec's device_vocabulary_size, TFRA's init_size) over the keys stored")
    p.add_argument("--expansion", action="store_true",
                   help="shardrec with init(use_dynamic_expansion=True): rows in use grow with the keys")
    args = p.parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    if args.peer == "shardrec":
        from shardrec.rank_runtime import init

        init(use_dynamic_expansion=args.expansion)
    steps = args.keys // args.batch

    def batch_of_new_keys(i):
        # Made in the graph, so the measurement holds no table of keys of its own.
        ranks = i * args.batch + tf.range(args.batch, dtype=tf.int64)
        ids = tf.math.floormod(ranks * 0x9E3779B97F, workload.KEY_RANGE)[:, None]
        return {"ids": ids, "rows": tf.zeros([args.batch, 1], tf.int32)}

    dataset = tf.data.Dataset.range(steps).map(batch_of_new_keys)
    op, setup = peers.PEERS[args.peer](dataset, DIM, "lazy_adam", int(args.keys * args.capacity_factor))
    proc = psutil.Process()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.constant(0))  # the runtime's own start-up memory is not the table's
        before = proc.memory_info().rss
        sess.run(tf.compat.v1.global_variables_initializer())
        setup(sess)
        for _ in range(steps):
            sess.run(op)
        after = proc.memory_info().rss
    stored = steps * args.batch
    payload = DIM * 4 * 3  # values + Adam's m and v
    print(json.dumps({"peer": args.peer, "keys": args.keys, "capacity_factor": args.capacity_factor,
                      "expansion": args.expansion, "bytes_per_key": (after - before) / stored, **_breakdown(args, stored),
                      "payload_bytes_per_key": payload, "note": "RSS growth from before the variables exist to after all keys are stored"}),
          flush=True)


def _breakdown(args, stored):
    """Where shardrec's bytes per key go, from the table's own counters."""
    if args.peer != "shardrec":
        return {}
    from shardrec.rank_runtime.process import config

    c = config.get_config().tables["emb"].counters()
    counted = {"value_bytes": c.store.values, "slot_bytes": c.store.slots, "metadata_bytes": c.store.metadata,
               "index_bytes": c.index_bytes}
    return {"counted_bytes_per_key": {k: v / stored for k, v in counted.items()}}


if __name__ == "__main__":
    main()
