"""Incremental checkpoints on the admission stream (admission_train.stream: keys admitted after 2
sightings, evicted 60 s after their last one, an eviction every 8 steps), lazy Adam, a dense weight.

    mpiexec -np N python incremental_job.py DIR train --saves f4,d8,d12,f16,d20,d24 [--plain] [--ssd D] [--expand]
        [--columns]
    mpiexec -np N python incremental_job.py DIR restore --paths P1,P2,... --tag T [--catch]
    mpiexec -np N python incremental_job.py DIR version --version S --tag T [--catch]
    mpiexec -np N python incremental_job.py DIR timers --steps 60 --sleep 0.05 --tag T

train: MonitoredTrainingSession without a checkpoint hook (EvictHook numbers the batches by global
step, so saves are exact as of their step); after step s of --saves it saves DIR/model-s as the
letter says (f: full, d: delta, Saver.save(save_delta=...)); --plain: init without incremental
checkpoints, every save full. restore: a plain Session restores each path in turn and dumps what
this rank holds to DIR/T-<i>-rank<r>-of<N>.npz. version: init(restore_model_version=S) and a
MonitoredTrainingSession on DIR restores; dumps as restore does. timers: incremental saves by
themselves (save_checkpoint_due_time=2, save_delta_checkpoints_secs=1) under MonitoredTrainingSession
(checkpoint_dir=DIR); dumps what it holds at the end (T-end-...) and, restored from the latest
checkpoint after the session closed, T-latest-.... --catch: a failing
restore prints "REFUSED rank=<r>: <message>" and the job ends with status 0; in train, a failing
save prints "SAVE-REFUSED rank=<r> step=<s>: <message>" (after --fill-after S filled the disk; rank
0 frees it again) and training goes on.
"""
import argparse
import os
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from admission_train import INIT, stream
from mx_rec.core.asc.feature_spec import FeatureSpec
from mx_rec.core.asc.helper import get_asc_insert_func
from mx_rec.core.asc.manager import start_asc_pipeline
from mx_rec.core.embedding import create_table, sparse_lookup
from mx_rec.core.feature_process import EvictHook
from mx_rec.optimizers.lazy_adam import create_hash_optimizer
from mx_rec.util.initialize import get_rank_id, get_rank_size, init, terminate_config_initializer
from mx_rec.util.variable import get_dense_and_sparse_variable

DIM = 4


def build(ssd, vocab=4096, columns=False):
    rank, size = get_rank_id(), get_rank_size()
    ids, ts = stream()
    ids, ts = ids[:, rank::size], ts[:, rank::size]
    spec = FeatureSpec("ids", table_name="emb", access_threshold=2, eviction_threshold=60)
    stamp = FeatureSpec("ts", is_timestamp=True)
    dataset = tf.data.Dataset.from_tensor_slices({"ids": ids, "ts": ts})
    dataset = dataset.map(get_asc_insert_func(tgt_key_specs=[spec, stamp], is_training=True)).prefetch(2)
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    tiers = dict(device_vocabulary_size=vocab)
    if ssd:
        tiers = dict(device_vocabulary_size=40, host_vocabulary_size=40, ssd_vocabulary_size=4096,
                     ssd_data_path=[ssd])
    # --columns: the table column-wise, half of each row on each of ranks 0 and 1 (on one rank: all of it).
    placed = dict(sharding="column_wise", sharding_rank=list(range(min(size, 2)))) if columns else {}
    table = create_table(key_dtype=tf.int64, dim=DIM, name="emb",
                         emb_initializer=tf.compat.v1.constant_initializer(INIT), **tiers, **placed)
    emb = sparse_lookup(table, spec, batch=batch, is_train=True)
    w = tf.compat.v1.get_variable("w", [DIM], initializer=tf.compat.v1.constant_initializer(0.5))
    loss = tf.reduce_mean(tf.square(tf.reduce_sum(emb * w, [1, 2]) - 1.0))
    dense, sparse = get_dense_and_sparse_variable()
    step = tf.compat.v1.train.get_or_create_global_step()
    train = tf.group(hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05)).minimize(
                         loss, var_list=dense, global_step=step),
                     create_hash_optimizer(learning_rate=0.05).apply_gradients(zip(tf.gradients(loss, sparse), sparse)))
    start_asc_pipeline()
    saver = tf.compat.v1.train.Saver(max_to_keep=100)
    tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.SAVERS, saver)  # MonitoredTrainingSession's saver
    return {"table": table, "train": train, "w": w, "step": step, "saver": saver}


def dump(sess, g, path):
    table = g["table"]
    rows = table.export(sess)
    counts, last_seen = table.index.read_metadata(table.index.export()[1])
    pending = table.index.export_pending()
    np.savez(path, w=sess.run(g["w"]), step=sess.run(g["step"]), counts=counts, last_seen=last_seen,
             on_ssd=table.index.rows_on_ssd(),
             pending_keys=pending.keys, pending_counts=pending.counts, pending_last_seen=pending.last_seen,
             **{k.replace(".", "_"): v for k, v in rows.items()})


def fill(path):
    """Writes `path` until its disk is full."""
    block = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError:
            pass
        block = b"\0"
        try:
            while True:
                f.write(block)
        except OSError:
            pass


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("mode", choices=["train", "restore", "version", "timers"])
    p.add_argument("--saves", default="")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--ssd")
    p.add_argument("--expand", action="store_true", help="init(use_dynamic_expansion=True)")
    p.add_argument("--columns", action="store_true", help="the table column-wise on ranks 0 and 1")
    p.add_argument("--paths", default="")
    p.add_argument("--tag", default="dump")
    p.add_argument("--version", type=int)
    p.add_argument("--catch", action="store_true")
    p.add_argument("--fill-after", type=int, help="after this step's save, rank 0 fills DIR's disk")
    p.add_argument("--grow-after", type=int, help="after this step's save, each rank adds --grow-keys keys")
    p.add_argument("--grow-keys", type=int, default=0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sleep", type=float, default=0.05)
    a = p.parse_args()
    tf.compat.v1.disable_eager_execution()
    incremental = {} if a.plain else dict(is_incremental_checkpoint=True, save_checkpoint_due_time=2,
                                          save_delta_checkpoints_secs=1)
    if a.mode == "version":
        incremental["restore_model_version"] = a.version
    init(use_dynamic_expansion=a.expand, **incremental)
    rank, size = get_rank_id(), get_rank_size()
    g = build(a.ssd, 4096 + a.grow_keys * size, a.columns)
    out = os.path.join(a.dir, f"{a.tag}-{{}}-rank{rank}-of{size}.npz")
    if a.mode == "restore":
        sess = tf.compat.v1.Session()
        sess.run(tf.compat.v1.global_variables_initializer())
        for i, path in enumerate(a.paths.split(",")):
            try:
                g["saver"].restore(sess, path)
            except Exception as e:  # noqa: BLE001 - the test reads the message
                if not a.catch:
                    raise
                print(f"REFUSED rank={rank}: {e}", flush=True)
                return
            dump(sess, g, out.format(i))
        sess.close()
    elif a.mode == "version":
        try:
            sess = tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=a.dir, save_checkpoint_steps=None,
                                                               save_checkpoint_secs=None, save_summaries_steps=None,
                                                               log_step_count_steps=None)
        except Exception as e:  # noqa: BLE001 - the test reads the message
            if not a.catch:
                raise
            print(f"REFUSED rank={rank}: {e}", flush=True)
            return
        dump(sess._tf_sess(), g, out.format(0))  # noqa: SLF001 - before any step
        sess.close()
    else:
        timers = a.mode == "timers"
        hooks = [EvictHook(evict_step_interval=8, evict_time_interval=None)]
        sess = tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=a.dir if timers else None, hooks=hooks,
                                                           save_summaries_steps=None, log_step_count_steps=None)
        raw = sess._tf_sess()  # noqa: SLF001 - saves and dumps between steps, outside the hooks
        saves = {int(s[1:]): s[0] for s in a.saves.split(",") if s}
        steps = a.steps if timers else max(saves)
        for step in range(1, steps + 1):
            sess.run(g["train"])
            if timers:
                time.sleep(a.sleep)
            elif step in saves:
                try:
                    g["saver"].save(raw, os.path.join(a.dir, "model"), global_step=step,
                                    save_delta=None if a.plain else saves[step] == "d")
                except Exception as e:  # noqa: BLE001 - the test reads the message
                    if not a.catch:
                        raise
                    print(f"SAVE-REFUSED rank={rank} step={step}: {e}", flush=True)
                    if rank == 0:
                        os.remove(os.path.join(a.dir, "filler"))
                if step == a.fill_after and rank == 0:
                    fill(os.path.join(a.dir, "filler"))
                if step == a.grow_after:  # new keys: rows the next delta must write (a big one)
                    g["table"].index.lookup(np.arange(a.grow_keys, dtype=np.int64) * size + rank + 10**9, allocate=True)
        if timers:
            dump(raw, g, out.format("end"))
        sess.close()  # the checkpoint hook's last save
        if timers:
            latest = tf.train.latest_checkpoint(a.dir)
            print(f"LATEST rank={rank} {latest}", flush=True)
            with tf.compat.v1.Session() as check:
                check.run(tf.compat.v1.global_variables_initializer())
                g["saver"].restore(check, latest)
                dump(check, g, out.format("latest"))
    terminate_config_initializer()


if __name__ == "__main__":
    main()
