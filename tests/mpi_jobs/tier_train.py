"""Trains one table on Zipf keys, with an SSD tier below a small memory budget or all in memory.

    mpiexec -np N python tier_train.py --out DIR --tag T --memory ROWS [--ssd ROWS --ssd-path DIR ...]
        [--start S --end E] [--save PREFIX] [--restore PATH] [--init constant|uniform] [--prefetch P]
        [--dim D] [--keys K] [--optimizer lazy_adam|adagrad|sgd] [--eval]

The global batches are fixed and each rank takes its slice, with the gradients of the global batch's
mean loss ("sum_gradients_and_div_by_ranksize"), so any rank count reproduces one rank. --memory is
device_vocabulary_size + host_vocabulary_size (split in halves when there is an SSD tier); without
--ssd the table is a plain one of --memory rows. Writes per rank: keys, values and optimizer slots
(read with table.export, from whichever tier holds them), the dense weights, the losses and the
table's counters (JSON).
"""
import argparse
import json
import os
import threading

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from mx_rec.core.asc.feature_spec import FeatureSpec
from mx_rec.core.asc.helper import get_asc_insert_func
from mx_rec.core.asc.manager import start_asc_pipeline
from mx_rec.core.embedding import create_table, sparse_lookup
from mx_rec.optimizers import adagrad, gradient_descent, lazy_adam
from mx_rec.util.initialize import get_rank_id, get_rank_size, init, terminate_config_initializer
from mx_rec.util.variable import get_dense_and_sparse_variable

FIELDS, DENSE = 4, 3
DATA_STEPS = 100  # the data is the same whatever --start and --end
OPTIMIZERS = {"lazy_adam": lambda: lazy_adam.create_hash_optimizer(0.01),
              "adagrad": lambda: adagrad.create_hash_optimizer(0.05),
              "sgd": lambda: gradient_descent.create_hash_optimizer(0.1)}


def global_data(keys, steps, batch, fresh):
    """Zipf-distributed ids over `keys` distinct int64 keys, fixed by the seed; fresh: every id a
    key never seen before."""
    rng = np.random.default_rng(11)
    if fresh:
        ids = np.arange(steps * batch * FIELDS, dtype=np.int64).reshape(-1, FIELDS) * 7919 + 13
    else:
        pool = rng.choice(2**50, size=keys, replace=False).astype(np.int64) - 2**49
        ids = pool[np.minimum(rng.zipf(1.1, size=(steps * batch, FIELDS)) - 1, keys - 1)]
    x = rng.normal(size=(steps * batch, DENSE)).astype(np.float32)
    y = rng.normal(size=steps * batch).astype(np.float32)
    return {"ids": ids, "x": x, "y": y}


def my_slice(data, rank, size, start, end, batch):
    local = batch // size
    rows = np.concatenate([np.arange(s * batch + rank * local, s * batch + (rank + 1) * local)
                           for s in range(start, end)] or [np.zeros(0, np.int64)])
    return {k: v[rows] for k, v in data.items()}, local


def corrupt_ssd_files(table):
    """Overwrites every record of this rank's SSD files with other bytes (headers kept)."""
    for path in table.index.ssd_files():
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.seek(4096)
            f.write(np.random.default_rng(1).integers(0, 256, size - 4096, dtype=np.uint8).tobytes())


def memory_status():
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmData", "VmHWM")):
                fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    return fields


def anon_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


class AnonPeak:
    """The peak anonymous resident memory (RssAnon: heap and anonymous maps, not the page cache or
    mapped files) while the block runs, sampled every `interval` seconds by a thread."""

    def __init__(self, interval=0.001):
        self.interval = interval

    def __enter__(self):
        self.peak, self._done = anon_rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(self.interval):
            self.peak = max(self.peak, anon_rss())

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, anon_rss())


def peak_since_reset(run, peaks, name):
    """peaks[name]: the peak resident memory (VmHWM) of `run()`, the peak reset to the present first;
    peaks[anon_<name>]: its peak anonymous memory."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with AnonPeak() as anon:
        run()
    peaks[name], peaks[f"anon_{name}"] = memory_status()["VmHWM"], anon.peak


def build(a, rank, size):
    if not 0 <= a.start <= a.end <= DATA_STEPS:
        raise ValueError(f"--start and --end must be in [0, {DATA_STEPS}]")
    data, local = my_slice(global_data(a.keys, DATA_STEPS, a.batch, a.fresh), rank, size, a.start, a.end, a.batch)
    spec = FeatureSpec("ids", table_name="emb")
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(local, drop_remainder=True)
    dataset = dataset.map(get_asc_insert_func([spec], is_training=True)).prefetch(a.prefetch)
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    batch = iterator.get_next()
    initializer = (tf.compat.v1.constant_initializer(0.05) if a.init == "constant"
                   else tf.compat.v1.random_uniform_initializer(-0.1, 0.1, seed=3))
    tiers = {}
    if a.ssd:
        tiers = dict(device_vocabulary_size=a.memory // 2, host_vocabulary_size=a.memory - a.memory // 2,
                     ssd_vocabulary_size=a.ssd, ssd_data_path=a.ssd_path)
    else:
        tiers = dict(device_vocabulary_size=a.memory)
    table = create_table(key_dtype=tf.int64, dim=a.dim, name="emb", emb_initializer=initializer,
                         all2all_gradients_op="sum_gradients_and_div_by_ranksize", **tiers)
    emb = sparse_lookup(table, spec, batch=batch, is_train=True)
    w = tf.compat.v1.get_variable("w", [FIELDS * a.dim + DENSE, 1],
                                  initializer=tf.compat.v1.glorot_uniform_initializer(seed=7))
    pred = tf.squeeze(tf.matmul(tf.concat([tf.reshape(emb, [-1, FIELDS * a.dim]), batch["x"]], 1), w), 1)
    loss = tf.reduce_mean(tf.square(pred - batch["y"]))
    dense, sparse = get_dense_and_sparse_variable()
    step = tf.compat.v1.train.get_or_create_global_step()
    dense_opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05), op=hvd.Average)
    train_op = tf.group(dense_opt.minimize(loss, var_list=dense, global_step=step),
                        OPTIMIZERS[a.optimizer]().apply_gradients(zip(tf.gradients(loss, sparse), sparse)))
    out = {"iterator": iterator, "train_op": train_op, "loss": loss, "table": table, "w": w, "dense": dense}
    if a.eval:
        # Evaluation reads rows from both tiers too (its own channel, its own pins).
        eval_spec = FeatureSpec("eval_ids", table_name="emb", index_key="ids")
        eval_data = tf.data.Dataset.from_tensor_slices({"ids": data["ids"][: 8 * local]}).batch(local)
        eval_data = eval_data.map(get_asc_insert_func([eval_spec], is_training=False))
        out["eval_iterator"] = tf.compat.v1.data.make_initializable_iterator(eval_data)
        eval_batch = out["eval_iterator"].get_next()
        out["eval_emb"] = sparse_lookup(table, eval_spec, batch=eval_batch, is_train=False)
        out["eval_ids"] = eval_batch["ids"]
    out["saver"] = tf.compat.v1.train.Saver()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--memory", type=int, required=True)
    p.add_argument("--ssd", type=int, default=0)
    p.add_argument("--ssd-path", nargs="*", default=None)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--end", type=int, default=60)
    p.add_argument("--save")
    p.add_argument("--save-every", type=int, default=0, help="also save after every this many steps")
    p.add_argument("--restore")
    p.add_argument("--init", default="uniform", choices=["constant", "uniform"])
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--keys", type=int, default=6000)
    p.add_argument("--optimizer", default="lazy_adam", choices=sorted(OPTIMIZERS))
    p.add_argument("--eval", action="store_true")
    p.add_argument("--batch", type=int, default=64, help="global batch (samples of FIELDS ids)")
    p.add_argument("--fresh", action="store_true", help="every id a new key")
    p.add_argument("--no-export", action="store_true", help="write counters only (rows larger than memory)")
    p.add_argument("--corrupt-at", type=int, default=-1, help="damage this rank's SSD files after this step")
    p.add_argument("--catch", action="store_true", help="print a training error instead of raising it")
    a = p.parse_args()

    tf.compat.v1.disable_eager_execution()
    init()
    rank, size = get_rank_id(), get_rank_size()
    g = build(a, rank, size)
    start_asc_pipeline()
    losses, evaluated = [], []
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_variables(g["dense"], root_rank=0))
        peaks = {}
        train_anon = AnonPeak(0.01).__enter__()
        if a.restore:
            peak_since_reset(lambda: g["saver"].restore(sess, a.restore), peaks, "peak_restore")
        sess.run(g["iterator"].initializer)
        try:
            for s in range(a.start, a.end):
                losses.append(sess.run([g["train_op"], g["loss"]])[1])
                if s == a.corrupt_at:
                    corrupt_ssd_files(g["table"])
                if a.save_every and (s + 1) % a.save_every == 0:
                    g["saver"].save(sess, a.save, global_step=s + 1)
                if a.eval and s % 20 == 19:
                    sess.run(g["eval_iterator"].initializer)
                    while True:
                        try:
                            evaluated.append(sess.run([g["eval_ids"], g["eval_emb"]]))
                        except tf.errors.OutOfRangeError:
                            break
        except Exception as e:  # noqa: BLE001 - the test reads what a user would see
            if not a.catch:
                raise
            print(f"TRAINING-ERROR rank={rank} step={len(losses) + a.start}: {' '.join(str(e).split())}", flush=True)
        peaks["peak_train"] = memory_status()["VmHWM"]
        train_anon.__exit__()
        peaks["anon_peak_train"] = train_anon.peak
        if a.save and not a.save_every:
            peak_since_reset(lambda: g["saver"].save(sess, a.save, global_step=a.start + len(losses)), peaks, "peak_save")
        export = {} if a.no_export else g["table"].export(sess)
        w = sess.run(g["w"])
    counters = g["table"].counters().as_dict()
    files = g["table"].index.ssd_files()
    with open(os.path.join(a.out, f"{a.tag}-rank{rank}-of{size}.json"), "w") as f:
        json.dump({k: int(v) for k, v in counters.items()} | memory_status() | peaks | {"ssd_files": files}, f)
    np.savez(os.path.join(a.out, f"{a.tag}-rank{rank}-of{size}.npz"), losses=np.array(losses, np.float32), w=w,
             eval_ids=np.concatenate([e[0].reshape(-1) for e in evaluated]) if evaluated else np.zeros(0, np.int64),
             eval_rows=(np.concatenate([e[1].reshape(-1, a.dim) for e in evaluated]) if evaluated
                        else np.zeros((0, a.dim), np.float32)),
             **export)
    terminate_config_initializer()


if __name__ == "__main__":
    main()
