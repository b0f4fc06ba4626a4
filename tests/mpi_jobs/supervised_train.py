"""A MonitoredTrainingSession job as users write one, for the supervisor's tests: it saves every
5 steps into CHECKPOINT_DIR and, started again, resumes there by itself; its data is a function of
the step (global batch s is the same whichever attempt runs it). At the end every rank dumps its
tables and the dense weights to OUT_DIR/final-rank<r>.npz.

    shardrec-run -np 2 --checkpoint-dir CKPT -- python supervised_train.py CKPT OUT_DIR

FAULT="<rank>:<step>:<kill|stop|raise>" makes that rank, in the first attempt only, SIGKILL or
SIGSTOP itself or raise, once the given step is done (tests only); STOP_AT ends the training (and
saves) at that step instead of TOTAL_STEPS. STEP_DELAY_S slows every step
down, for tests that act on the job from outside while it runs. ACCESS_THRESHOLD sets the feature's
access_threshold (default -1: no admission); EVICT_AFTER=T gives it eviction_threshold T over a
timestamp column (the step of each sample) with EvictHook every 3 steps; SSD_DIR gives the table
an SSD tier there, below a memory budget of 128 rows a rank. SAVE_STEPS (default 5) is how often
it saves; NO_FINAL_SAVE=1 makes it a loop that does not save when it ends (its checkpoint hook
saves at the start and every SAVE_STEPS steps only).
"""
import os
import signal
import sys
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from mx_rec.core.feature_process import EvictHook
from mx_rec.optimizers import lazy_adam
from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable,
                                   get_rank_id, get_rank_size, init, report, sparse_lookup, start_asc_pipeline)

TOTAL_STEPS, GLOBAL_BATCH, FIELDS, DIM = 30, 16, 3, 4


def global_batches():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 400, size=(TOTAL_STEPS, GLOBAL_BATCH, FIELDS)).astype(np.int64)
    y = rng.normal(size=(TOTAL_STEPS, GLOBAL_BATCH)).astype(np.float32)
    return ids, y


def fault(rank, step):
    spec = os.environ.get("FAULT")
    if not spec or os.environ.get("SHARDREC_ATTEMPT", "0") != "0":
        return
    who, at, what = spec.split(":")
    if int(who) != rank or int(at) != step:
        return
    print(f"FAULT rank={rank} step={step} {what}", flush=True)
    if what == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif what == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    raise RuntimeError(f"injected failure on rank {rank} at step {step}")


class SavesOnlyOnSchedule(tf.compat.v1.train.CheckpointSaverHook):
    def end(self, session):
        pass


def main(checkpoint_dir, out_dir):
    tf.compat.v1.disable_eager_execution()
    init(sharding_plan=os.environ.get("SHARDING_PLAN"))
    rank, size = get_rank_id(), get_rank_size()
    latest = tf.train.latest_checkpoint(checkpoint_dir)
    start = int(latest.rsplit("-", 1)[1]) if latest else 0
    ids, y = global_batches()
    local = GLOBAL_BATCH // size
    mine = slice(rank * local, (rank + 1) * local)
    columns = {"ids": ids[start:, mine], "y": y[start:, mine]}
    evict_after = os.environ.get("EVICT_AFTER")
    spec = FeatureSpec("ids", table_name="emb", access_threshold=int(os.environ.get("ACCESS_THRESHOLD", "-1")),
                       eviction_threshold=int(evict_after) if evict_after else None)
    specs, hooks = [spec], [tf.compat.v1.train.StopAtStepHook(last_step=int(os.environ.get("STOP_AT", TOTAL_STEPS)))]
    if evict_after:
        # A sample's time is its step: eviction then depends on the data alone, whichever ranks run it.
        columns["ts"] = np.broadcast_to(np.arange(TOTAL_STEPS, dtype=np.int64)[:, None], y.shape)[start:, mine]
        specs.append(FeatureSpec("ts", is_timestamp=True))
        hooks.append(EvictHook(evict_step_interval=3, evict_time_interval=None))
    dataset = tf.data.Dataset.from_tensor_slices(columns)
    dataset = dataset.map(get_asc_insert_func(specs, is_training=True)).prefetch(2)
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    tiers = dict(device_vocabulary_size=1000)
    if os.environ.get("SSD_DIR"):
        tiers = dict(device_vocabulary_size=64, host_vocabulary_size=192, ssd_vocabulary_size=2000,
                     ssd_data_path=[os.environ["SSD_DIR"]])
    table = create_table(tf.int64, DIM, "emb", tf.compat.v1.truncated_normal_initializer(stddev=0.1, seed=1), **tiers)
    emb = sparse_lookup(table, spec, batch=batch)
    w = tf.compat.v1.get_variable("w", [FIELDS * DIM, 1], initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
    loss = tf.reduce_mean(tf.square(tf.squeeze(tf.matmul(tf.reshape(emb, [-1, FIELDS * DIM]), w), 1) - batch["y"]))
    dense, sparse = get_dense_and_sparse_variable()
    step = tf.compat.v1.train.get_or_create_global_step()
    train_op = tf.group(
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05)).minimize(loss, var_list=dense,
                                                                                             global_step=step),
        lazy_adam.create_hash_optimizer(0.02).apply_gradients(zip(tf.gradients(loss, sparse), sparse)))
    start_asc_pipeline()
    with tf.control_dependencies([train_op]):
        after = {"w": w.read_value(), "rows": table.variable.read_value()}  # the state this step leaves
    save_steps = int(os.environ.get("SAVE_STEPS", "5"))
    if os.environ.get("NO_FINAL_SAVE") == "1":
        hooks.append(SavesOnlyOnSchedule(checkpoint_dir, save_steps=save_steps))
        save_steps = None  # no default hook
    # Every rank is a chief: each writes its table shard at the same steps (rank 0 the dense part).
    with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=checkpoint_dir, is_chief=True, save_checkpoint_steps=save_steps,
            save_summaries_steps=None, save_summaries_secs=None, log_step_count_steps=None,
            hooks=hooks) as sess:
        state, done = None, start
        while not sess.should_stop():
            value, state = sess.run([loss, after])
            done += 1
            report(step=done, loss=value, total_steps=TOTAL_STEPS)
            fault(rank, done)
            time.sleep(float(os.environ.get("STEP_DELAY_S", "0")))
    if state is None:
        print(f"DONE rank={rank} step={done} resumed_from={start} (nothing left to train)", flush=True)
        return
    export = table.export(None)  # every tier's rows, read from the native core
    np.savez(os.path.join(out_dir, f"final-rank{rank}.npz"), w=state["w"], step=done, keys=export["keys"],
             rows=export["values"])
    print(f"DONE rank={rank} step={done} resumed_from={start}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
