"""16-bit rows (create_table's value_dtype / slot_dtype) against float32: memory per row from the
table's own counters, and the step's CPU time per id.

    python bench/row_dtypes.py [--dims 16,128] [--optimizers lazy_adam,sgd] [--rounds 3]
    mpiexec -np 2 python bench/row_dtypes.py ...            (rank 0 prints)
    python bench/row_dtypes.py --auc-seeds 2024,7,11 [--auc-steps 600]   (accuracy: the demo's AUC)

Each configuration builds its table, trains `--steps` timed steps of Zipf(1.1) ids (26 fields,
batch 4096, the same batches for every configuration) after `--warmup`, and is torn down; the
configurations alternate in one process (float32, float16, bfloat16, float16 + bfloat16 slots,
float32, ...) so that the machine's drift hits all. Prints one JSON line per (optimizer, dim):
per configuration bytes per row (values, slots and metadata: table.counters().bytes_per_row), the
ratio to float32, CPU microseconds per id (every thread of the process, getrusage) and its ratio
to float32, medians of the rounds with their spread.

--auc-seeds trains the demo (examples/wide_deep.py, one rank, lazy Adam, its own click data) once per
seed and configuration of the deep table, configurations alternating, and prints one JSON line per
configuration: the held-out AUC of each seed and its difference from float32's.
"""
import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile

import numpy as np
import tensorflow as tf

from mx_rec.optimizers import gradient_descent, lazy_adam
from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable,
                                   init, sparse_lookup, start_asc_pipeline)
from shardrec.rank_runtime.process import lifecycle

CONFIGS = {"float32": ("float32", None), "float16": ("float16", None), "bfloat16": ("bfloat16", None),
           "float16+bf16_slots": ("float16", "bfloat16"), "bfloat16+bf16_slots": ("bfloat16", "bfloat16")}
FIELDS = 26


def batches(rank, batch, count):
    rng = np.random.default_rng(100 + rank)
    return (rng.zipf(1.1, size=(count, batch, FIELDS)) % (2**40)).astype(np.int64)


def measure(config, ids, dim, optimizer, steps, warmup, vocabulary):
    values, slots = CONFIGS[config]
    tf.compat.v1.reset_default_graph()
    init()
    spec = FeatureSpec("ids", table_name="emb")
    data = tf.data.Dataset.from_tensor_slices({"ids": ids}).map(get_asc_insert_func([spec])).prefetch(2)
    element = tf.compat.v1.data.make_one_shot_iterator(data).get_next()
    table = create_table(tf.int64, dim, "emb", tf.compat.v1.truncated_normal_initializer(stddev=0.05, seed=1),
                         device_vocabulary_size=vocabulary, value_dtype=values, slot_dtype=slots)
    emb = sparse_lookup(table, spec, batch=element)
    loss = tf.reduce_mean(tf.square(tf.reduce_sum(emb, [1, 2]) - 1.0))
    _, sparse = get_dense_and_sparse_variable()
    step = tf.compat.v1.train.get_or_create_global_step()
    opt = gradient_descent.create_hash_optimizer(0.01) if optimizer == "sgd" else lazy_adam.create_hash_optimizer(0.001)
    train = opt.apply_gradients(zip(tf.gradients(loss, sparse), sparse), global_step=step)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in range(warmup):
            sess.run(train)
        cpu0 = _cpu()
        for _ in range(steps):
            sess.run(train)
        cpu = _cpu() - cpu0
        try:  # the end of the pass, on every rank together
            sess.run(train)
            raise RuntimeError("bench/row_dtypes.py: the dataset holds more batches than warmup + steps")
        except tf.errors.OutOfRangeError:
            pass
    counters = table.counters()
    out = {"bytes_per_row": counters.bytes_per_row, "cpu_us_per_id": 1e6 * cpu / (steps * ids.shape[1] * FIELDS),
           "index_bytes_per_key": counters.index_bytes / max(counters.size, 1)}
    lifecycle.terminate_config_initializer()
    return out


def demo_auc(config, seed, steps):
    """The demo's held-out AUC with the deep table in `config`."""
    values, slots = CONFIGS[config]
    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "wide_deep.py")
    with tempfile.TemporaryDirectory() as model_dir:
        proc = subprocess.run([sys.executable, demo, "--model-dir", model_dir, "--seed", str(seed), "--steps", str(steps),
                               "--value-dtype", values, "--slot-dtype", slots or "float32"],
                              capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    found = re.search(r"SUMMARY .*eval_auc=([0-9.]+)", proc.stdout)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"the demo failed ({config}, seed {seed}): {proc.stderr[-3000:]}")
    return float(found.group(1))


def auc_lines(configs, seeds, steps):
    aucs = {c: [] for c in configs}
    for seed in seeds:
        for c in configs:
            aucs[c].append(demo_auc(c, seed, steps))
    for c, values in aucs.items():
        line = {"config": c, "steps": steps, "seeds": seeds, "auc": values}
        if "float32" in aucs:
            diff = [v - b for v, b in zip(values, aucs["float32"])]
            line.update(auc_minus_float32=[round(d, 4) for d in diff], mean_difference=round(float(np.mean(diff)), 4))
        print(json.dumps(line), flush=True)


def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dims", default="16,128")
    p.add_argument("--optimizers", default="lazy_adam,sgd")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--auc-seeds", default=None, help="the demo's AUC per seed and configuration instead")
    p.add_argument("--auc-steps", type=int, default=600)
    a = p.parse_args()
    if a.auc_seeds:
        return auc_lines(a.configs.split(","), [int(s) for s in a.auc_seeds.split(",")], a.auc_steps)
    tf.compat.v1.disable_eager_execution()
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    ranks = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    ids = batches(rank, a.batch, a.steps + a.warmup + 0)
    vocabulary = int(1.1 * len(np.unique(np.concatenate([batches(r, a.batch, a.steps + a.warmup).ravel()
                                                        for r in range(ranks)])))) + 1024
    configs = a.configs.split(",")
    for optimizer in a.optimizers.split(","):
        for dim in map(int, a.dims.split(",")):
            runs = {c: [] for c in configs}
            for _ in range(a.rounds):
                for c in configs:
                    runs[c].append(measure(c, ids, dim, optimizer, a.steps, a.warmup, vocabulary))
            if rank != 0:
                continue
            base = runs["float32"] if "float32" in runs else None
            line = {"optimizer": optimizer, "dim": dim, "ranks": ranks, "ids_per_step": a.batch * FIELDS}
            for c, rs in runs.items():
                cpu = [r["cpu_us_per_id"] for r in rs]
                entry = {"bytes_per_row": rs[0]["bytes_per_row"],
                         "index_bytes_per_key": round(rs[0]["index_bytes_per_key"], 1),
                         "cpu_us_per_id": float(np.median(cpu)),
                         "cpu_spread": [float(min(cpu)), float(max(cpu))]}
                if base:
                    entry["memory_saving"] = base[0]["bytes_per_row"] / rs[0]["bytes_per_row"]
                    entry["cpu_ratio"] = float(np.median(cpu) / np.median([r["cpu_us_per_id"] for r in base]))
                line[c] = entry
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
