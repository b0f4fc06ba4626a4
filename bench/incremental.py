"""Incremental checkpoints: what a delta save costs against a full save of the same table, and what
tracking the changed rows costs the step.

    python bench/incremental.py [--keys 5000000] [--dim 16] [--rounds 3] [--step-rounds 3]

Saves (one rank, lazy Adam, so each row has values and two slots): the table holds --keys keys; each
round saves a full checkpoint, trains one step of the sparse step's workload (about 1% of the rows
change: the step's distinct keys), and saves a delta. Both go through the Saver as a job's saves do
(tables and the dense part, committed), each after os.sync(), so that no earlier write is still in
flight (a job's saves are seconds apart). Step: bench/sparse_step.py --track-changes alternate in
--step-rounds processes (16 windows of 8 steps each, tracking off and on in turns). Prints one
JSON line; medians of the rounds.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peers  # noqa: E402
import workload  # noqa: E402


def bytes_of(directory, step):
    sparse = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(os.path.join(directory, f"sparse-model-{step}"))
                 for f in files)
    dense = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.startswith(f"model-{step}."))
    return sparse, dense


def saves(args):
    from shardrec.rank_runtime.process import config
    from shardrec.rank_runtime import init

    init(is_incremental_checkpoint=True, save_checkpoint_due_time=2**31 - 1, save_delta_checkpoints_secs=1)
    keys, rows, _ = workload.make_batches(1, args.batch, args.fields, args.distinct)
    capacity = args.keys + int(keys.size) + 16
    op, setup = peers.PEERS["shardrec"](workload.batch_dataset(keys, rows), args.dim, "lazy_adam", capacity)
    table = config.get_table("emb")
    # max_to_keep=0: the Saver deletes nothing inside a timed save (each round's files go after it).
    saver = tf.compat.v1.train.Saver(max_to_keep=0)
    root = tempfile.mkdtemp(prefix="shardrec-bench-incremental-", dir=args.dir)
    out = {"full_s": [], "delta_s": [], "full_bytes": [], "delta_bytes": [], "changed_rows": []}
    try:
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            step = setup(sess) or (lambda: sess.run(op))
            step()
            table.index.lookup(np.arange(args.keys - table.size(), dtype=np.int64) + 2**40, allocate=True)
            held = table.size()
            for r in range(args.rounds):
                full_at, delta_at = 2 * r + 1, 2 * r + 2
                directory = os.path.join(root, f"round-{r}")
                os.sync()  # each save starts with no other write in flight (a job's saves are seconds apart)
                start = time.perf_counter()
                saver.save(sess, os.path.join(directory, "model"), global_step=full_at, save_delta=False)
                out["full_s"].append(time.perf_counter() - start)
                out["full_bytes"].append(sum(bytes_of(directory, full_at)))
                step()
                out["changed_rows"].append(table.index.changed_rows())
                os.sync()
                start = time.perf_counter()
                saver.save(sess, os.path.join(directory, "model"), global_step=delta_at, save_delta=True)
                out["delta_s"].append(time.perf_counter() - start)
                out["delta_bytes"].append(sum(bytes_of(directory, delta_at)))
                shutil.rmtree(directory)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: float(np.median(v)) for k, v in out.items()}
    return {"keys": held, "dim": args.dim, "changed_fraction": med["changed_rows"] / held,
            "full_save_s": med["full_s"], "delta_save_s": med["delta_s"], "time_ratio": med["delta_s"] / med["full_s"],
            "full_save_bytes": med["full_bytes"], "delta_save_bytes": med["delta_bytes"],
            "bytes_ratio": med["delta_bytes"] / med["full_bytes"], "rounds": out}


def step_speed(args):
    """The sparse step's ids/s with change tracking on against off: in each of --step-rounds
    processes, windows of steps alternate between the two (a process's own speed varies less than
    one process's from another's on this VM); the median of the processes' ratios."""
    ratios, windows = [], []
    for _ in range(args.step_rounds):
        cmd = [sys.executable, os.path.join(HERE, "sparse_step.py"), "--peer", "shardrec", "--dim", str(args.dim),
               "--optimizer", "lazy_adam", "--track-changes", "alternate", "--windows", "16", "--steps", "128"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        ratios.append(result["tracking_ratio"])
        windows.append(result["windows_by_mode"])
    return {"step_ratio": float(np.median(ratios)), "step_ratios": ratios, "step_windows": windows}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--keys", type=int, default=5_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=4096, help="the step's samples (26 ids each)")
    p.add_argument("--fields", type=int, default=26)
    p.add_argument("--distinct", type=int, default=10_000_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--step-rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the temporary directory)")
    args = p.parse_args()
    tf.compat.v1.disable_eager_execution()
    result = saves(args)
    if args.step_rounds:
        result.update(step_speed(args))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
