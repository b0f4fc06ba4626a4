"""Where one peer's sparse step spends its time, per op: a RunMetadata trace of a few steps after
warm-up, each op's time summed and averaged per step, largest first.

    python bench/op_profile.py --peer shardrec --dim 16 --optimizer lazy_adam [--steps 10] [--top 14]

Same workload and peers as bench/sparse_step.py. Op times overlap when ops run in parallel, so
they need not add up to the step's wall time (printed first).
"""
import argparse
import collections
import os
import sys
import time

import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402
import workload  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", choices=sorted(peers.PEERS), required=True)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--optimizer", choices=["sgd", "lazy_adam"], default="lazy_adam")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    if args.peer == "shardrec":
        from shardrec.rank_runtime import init

        init()
    keys, rows, seen = workload.make_batches(40, 4096, 26, 10_000_000, seed=0)
    op, setup = peers.PEERS[args.peer](workload.batch_dataset(keys, rows), args.dim, args.optimizer,
                                       int(seen * 1.05) + 16)
    per_op, wall = collections.Counter(), 0.0
    trace = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        setup(sess)
        for _ in range(args.warmup):
            sess.run(op)
        for _ in range(args.steps):
            metadata = tf.compat.v1.RunMetadata()
            start = time.perf_counter()
            sess.run(op, options=trace, run_metadata=metadata)
            wall += time.perf_counter() - start
            for device in metadata.step_stats.dev_stats:
                for node in device.node_stats:
                    kind = node.timeline_label.split("=", 1)[1].split("(")[0].strip() if "=" in node.timeline_label \
                        else ""
                    per_op[f"{node.node_name.split(':')[0]} ({kind})"] += node.all_end_rel_micros
    print(f"{args.peer} dim {args.dim} {args.optimizer}: {1e3 * wall / args.steps:.2f} ms per traced step")
    for name, micros in per_op.most_common(args.top):
        print(f"  {micros / args.steps / 1e3:8.2f} ms  {name}")


if __name__ == "__main__":
    main()
