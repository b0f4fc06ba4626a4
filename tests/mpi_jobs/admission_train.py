"""Admission and eviction on a stream whose key counts and timestamps are known in advance.

    mpiexec -np N python admission_train.py OUT_DIR MODE [--stop-at S] [--expand] [--tag T]

MODE admit: access_threshold 3, no eviction, a plain Session; after training, an evaluation pass
(which must change no count) and the evaluation lookups' rows. evict_steps: access_threshold 2,
eviction_threshold 60 s, EvictHook(evict_step_interval=8) under MonitoredTrainingSession with a
checkpoint directory (OUT_DIR/ckpt): --stop-at S stops (and saves) after global step S, and a later
run resumes from the checkpoint, with any number of ranks. evict_time: the same thresholds,
EvictHook(evict_time_interval=3) alone; training sleeps 3.5 s after step 20, so the time interval
fires there (each eviction's step is recorded, for the oracle). churn: dynamic expansion, 16,384
keys never seen before in every global batch (each twice: admitted at once), timestamps one second
a step, eviction_threshold 4 s and an eviction every 2 steps for 110 steps; records the resident
memory and the rows in use after every eviction. --expand: dynamic expansion.

The global batch b is the same whatever the number of ranks (rank r of N takes samples r::N), so the
global counts, and with them what is admitted and evicted, do not depend on N. The dataset
prefetches (--prefetch, default 1), so the key pipeline runs ahead of training: a save must take
back what it counted beyond the saved step.
Writes per rank OUT_DIR/<tag>-rank<r>.npz: the table's keys, counts, last-seen timestamps, pending
keys, every step's ids and the rows the forward pass read, and the steps where evictions happened.
"""
import argparse
import os
import time

import numpy as np
import psutil
import tensorflow as tf

from mx_rec.core.asc.feature_spec import FeatureSpec
from mx_rec.core.asc.helper import get_asc_insert_func
from mx_rec.core.asc.manager import start_asc_pipeline
from mx_rec.core.embedding import create_table, sparse_lookup
from mx_rec.core.feature_process import EvictHook
from mx_rec.optimizers.gradient_descent import create_hash_optimizer
from mx_rec.util.initialize import get_rank_id, get_rank_size, init, terminate_config_initializer
from mx_rec.util.variable import get_dense_and_sparse_variable
from shardrec.rank_runtime.formats.channel import Channel
from shardrec.rank_runtime.process.world import get_world

GLOBAL_BATCH, IDS_PER_SAMPLE, DIM, STEPS = 48, 2, 4, 40
INIT = 0.25
THRESHOLDS = {"admit": (3, -1), "evict_steps": (2, 60), "evict_time": (2, 60), "churn": (2, 4)}
CHURN_KEYS, CHURN_STEPS, CHURN_DIM = 16384, 110, 64
STEP_INTERVAL, TIME_INTERVAL, SLEEP_AFTER = 8, 3, 20


def stream():
    """(ids [STEPS, GLOBAL_BATCH, 2], timestamps [STEPS, GLOBAL_BATCH]): a window of 60 keys that
    slides 3 keys a step, frequent keys at its start; some keys leave and come back later."""
    rng = np.random.default_rng(11)
    ids = np.empty((STEPS, GLOBAL_BATCH, IDS_PER_SAMPLE), np.int64)
    weights = 1.0 / np.arange(1, 61)
    weights /= weights.sum()
    for s in range(STEPS):
        window = np.arange(3 * s, 3 * s + 60)
        ids[s] = rng.choice(window, size=(GLOBAL_BATCH, IDS_PER_SAMPLE), p=weights)
        if s >= 30:
            ids[s, :4] = np.arange(4)[:, None] * 7 + 1  # keys 1, 8, 15, 22 return after their eviction
    ts = 1000 + 10 * np.arange(STEPS)[:, None] + np.arange(GLOBAL_BATCH)[None, :] % 5
    return ids, ts.astype(np.int64)


def churn_stream():
    keys = np.arange(CHURN_STEPS * CHURN_KEYS, dtype=np.int64).reshape(CHURN_STEPS, CHURN_KEYS)
    ts = np.repeat(np.arange(CHURN_STEPS, dtype=np.int64)[:, None], CHURN_KEYS, axis=1)
    return np.stack([keys, keys], axis=-1), ts


def eval_ids():
    """Keys of every kind: admitted, counting (seen fewer than 3 times) and never seen."""
    return np.arange(0, 300, dtype=np.int64).reshape(-1, 2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("mode", choices=sorted(THRESHOLDS))
    p.add_argument("--stop-at", type=int, default=STEPS)
    p.add_argument("--expand", action="store_true")
    p.add_argument("--tag", default=None)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--ssd", help="an SSD tier in this directory, below a memory budget of --memory rows in all")
    p.add_argument("--memory", type=int, default=128)
    a = p.parse_args()
    tag = a.tag or a.mode
    tf.compat.v1.disable_eager_execution()
    churn = a.mode == "churn"
    init(use_dynamic_expansion=a.expand or churn)
    rank, size = get_rank_id(), get_rank_size()
    ckpt = os.path.join(a.out, "ckpt")
    latest = tf.train.latest_checkpoint(ckpt) if a.mode != "admit" else None
    start = int(latest.rsplit("-", 1)[1]) if latest else 0
    ids, ts = churn_stream() if churn else stream()
    stop = len(ids) if churn else a.stop_at
    # The data goes on past --stop-at: the pipeline looks batches up beyond the step of the save.
    ids, ts = ids[start:, rank::size], ts[start:, rank::size]
    dim = CHURN_DIM if churn else DIM
    access, eviction = THRESHOLDS[a.mode]
    spec = FeatureSpec("ids", table_name="emb", access_threshold=access, eviction_threshold=eviction)
    stamp = FeatureSpec("ts", is_timestamp=True)
    dataset = tf.data.Dataset.from_tensor_slices({"ids": ids, "ts": ts})
    dataset = dataset.map(get_asc_insert_func(tgt_key_specs=[spec, stamp], is_training=True)).prefetch(a.prefetch)
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    tiers = dict(device_vocabulary_size=4096)
    if a.ssd:
        tiers = dict(device_vocabulary_size=a.memory // 2, host_vocabulary_size=a.memory - a.memory // 2,
                     ssd_vocabulary_size=4096, ssd_data_path=[a.ssd])
    table = create_table(key_dtype=tf.int64, dim=dim, name="emb", emb_initializer=tf.compat.v1.constant_initializer(INIT),
                         **tiers)
    emb = sparse_lookup(table, spec, batch=batch, is_train=True)
    eval_spec = FeatureSpec("eval_ids", table_name="emb")
    eval_data = tf.data.Dataset.from_tensors({"eval_ids": eval_ids()}).map(
        get_asc_insert_func(tgt_key_specs=[eval_spec], is_training=False))
    eval_iterator = tf.compat.v1.data.make_initializable_iterator(eval_data)
    eval_emb = sparse_lookup(table, eval_spec, batch=eval_iterator.get_next(), is_train=False)
    weights = tf.constant(np.linspace(-1, 1, dim), tf.float32)
    loss = tf.reduce_sum(emb * weights)
    global_step = tf.compat.v1.train.get_or_create_global_step()
    _, sparse = get_dense_and_sparse_variable()
    train = tf.group(create_hash_optimizer(learning_rate=0.1).apply_gradients(zip(tf.gradients(loss, sparse), sparse)),
                     global_step.assign_add(1))
    start_asc_pipeline()
    exchange = get_world().exchanges[Channel.TRAIN]
    embs, evicted_at, rss, in_use = [], [], [], []
    if a.mode == "admit":
        sess = tf.compat.v1.Session()
        sess.run(tf.compat.v1.global_variables_initializer())
        raw = sess
    else:
        hook = (EvictHook(evict_time_interval=TIME_INTERVAL) if a.mode == "evict_time"
                else EvictHook(evict_step_interval=2 if churn else STEP_INTERVAL, evict_time_interval=None))
        sess = tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=ckpt, hooks=[hook],
                                                           save_checkpoint_steps=10**6, save_summaries_steps=None,
                                                           log_step_count_steps=None)
        raw = sess._tf_sess()  # noqa: SLF001 - the export and eval below run outside the hooks
    for step in range(start, stop):
        before = exchange.counters().evictions
        _, rows = sess.run([train, emb])
        if not churn:
            embs.append(rows)
        if exchange.counters().evictions != before:
            # The step of the exchange that evicted: the input pipeline may run ahead of training.
            evicted_at.append(exchange.counters().last_eviction_step)
            rss.append(psutil.Process().memory_info().rss)
            in_use.append(table.capacity())
        if a.mode == "evict_time" and step == SLEEP_AFTER:
            time.sleep(TIME_INTERVAL + 0.5)
    if a.mode != "churn" and stop < STEPS:
        # The save below must find batches looked up beyond its step: let the prefetch get there.
        deadline = time.monotonic() + 60
        while exchange.step <= stop and time.monotonic() < deadline:
            time.sleep(0.01)
    looked_up = exchange.step  # training steps whose batches the pipeline has looked up
    export = table.export(raw)
    counts, last_seen = table.index.read_metadata(table.index.export()[1])
    exported = table.index.export_pending()
    pending = (exported.keys, exported.counts, exported.last_seen)
    eval_rows = None
    if a.mode == "admit":
        raw.run(eval_iterator.initializer)
        eval_rows = raw.run(eval_emb)
        after = table.index.read_metadata(table.index.export()[1])
        assert np.array_equal(after[0], counts) and np.array_equal(after[1], last_seen), "evaluation changed counts"
        assert np.array_equal(table.index.export_pending().counts, pending[1]), "evaluation changed pending counts"
    counters = table.counters().as_dict()
    sess.close()
    np.savez(os.path.join(a.out, f"{tag}-rank{rank}.npz"), keys=export["keys"], values=export["values"],
             counts=counts, last_seen=last_seen, pending_keys=pending[0], pending_counts=pending[1],
             pending_last_seen=pending[2], ids=ids if not churn else np.zeros(0), embs=np.array(embs), evicted_at=np.array(evicted_at, np.int64),
             eval_rows=eval_rows if eval_rows is not None else np.zeros(0), start=start,
             sentinel=np.zeros(0) if a.expand or churn else table.store.read_rows(0, np.array([table.sentinel], np.int32)),
             counters=np.array([counters[k] for k in ("admitted", "rejected", "evicted", "reused")]),
             rss=np.array(rss), in_use=np.array(in_use), index_bytes=counters["index_bytes"],
             swapped=np.array([counters.get("swapped_in", 0), counters.get("swapped_out", 0)]),
             looked_up=looked_up)
    terminate_config_initializer()


if __name__ == "__main__":
    main()
