"""The main job: a Wide&Deep CTR model trained in tf.Session mode with the Rec SDK's call sequence
(seed 001): init -> datasets with get_asc_insert_func -> optimizers -> create_table -> sparse_lookup
-> get_dense_and_sparse_variable -> start_asc_pipeline -> Session loop with Saver -> terminate.

    mpiexec -np 2 python examples/wide_deep.py [--steps N] [--batch-size B] ...
    python examples/wide_deep.py ...            (one process)
    shardrec-run -np 2 --checkpoint-dir D -- python examples/wide_deep.py --model-dir D --save-every 100

A run whose --model-dir holds a checkpoint (or that the supervisor restarts from one) restores it
and continues from its step, on the data that step had not yet read.

Each rank reads its own shard of the data; tables are sharded over the ranks; dense gradients
are averaged with Horovod's allreduce (the one line a Rec SDK script changes: HCCL -> Horovod).
"""
import argparse
import json
import os
import sys
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import criteo_synth  # noqa: E402

from mx_rec.core.asc.feature_spec import FeatureSpec  # noqa: E402
from mx_rec.core.asc.helper import get_asc_insert_func  # noqa: E402
from mx_rec.core.asc.manager import start_asc_pipeline  # noqa: E402
from mx_rec.core.embedding import create_table, sparse_lookup  # noqa: E402
from mx_rec.optimizers.lazy_adam import create_hash_optimizer  # noqa: E402
from mx_rec.util.initialize import get_rank_id, get_rank_size, init, terminate_config_initializer  # noqa: E402
from mx_rec.util.variable import get_dense_and_sparse_variable  # noqa: E402
from shardrec.rank_runtime import export_saved_model, report, resume_checkpoint  # noqa: E402
from shardrec.rank_runtime.process.logs import get_logger  # noqa: E402
from shardrec.rank_runtime.pipeline.step_profile import StepTimeline, row_exchange_share, traced_run_options  # noqa: E402
from shardrec.rank_runtime.formats.channel import Channel  # noqa: E402
from shardrec.rank_runtime.process.world import get_world  # noqa: E402

log = get_logger("shardrec.wide_deep")
DEEP_DIM = 16
BLOCK_STEPS = 50


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="training steps")
    p.add_argument("--batch-size", type=int, default=512, help="per-rank batch size")
    p.add_argument("--global-batch-size", type=int, default=0,
                   help="a global batch split over the ranks instead (a multiple of the number of ranks), from one "
                        "stream of samples: global step s reads the same samples whatever the number of ranks, as an "
                        "elastic job (shardrec-run --host-discovery-script) needs")
    p.add_argument("--eval-samples", type=int, default=50_000, help="held-out samples for AUC")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--static-shapes", action="store_true", help="init(use_dynamic=False) with send_count")
    p.add_argument("--model-dir", default="saved-model",
                   help="where the Saver writes (dir/model-<step>); a checkpoint already there is resumed")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (default 0: at the end only)")
    p.add_argument("--incremental", default=None, metavar="FULL_S,DELTA_S",
                   help="incremental checkpoints (the guide's init(is_incremental_checkpoint=True, "
                        "save_checkpoint_due_time=FULL_S, save_delta_checkpoints_secs=DELTA_S)): Saver.maybe_save "
                        "after every step writes a full checkpoint or a delta as the timers say")
    p.add_argument("--parquet", default=None, metavar="DIR",
                   help="train from Parquet files (ParquetDataset): each rank's samples are written to DIR by the "
                        "first run of a rank count, and read back from there (a resumed run keeps the rank count)")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--value-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="how the deep table holds its values (create_table's value_dtype)")
    p.add_argument("--slot-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="how the deep table holds its optimizer slots (create_table's slot_dtype)")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="after training, rank 0 exports the model for serving (a SavedModel of stock TensorFlow ops)")
    p.add_argument("--eval-predictions", default=None, metavar="PREFIX",
                   help="each rank writes its held-out predictions to PREFIX-rank<r>.npy")
    p.add_argument("--warmup-steps", type=int, default=20,
                   help="steps before the throughput clock starts (session start, table initialisation, first "
                        "batches excluded)")
    p.add_argument("--trace-steps", type=int, default=0,
                   help="trace the last N steps: the row all-to-all's share of step time, and rank 0 prints the "
                        "step timeline of every rank (compute, waits for each exchange, moving rows, the key "
                        "pipeline; rank_runtime/pipeline/step_profile.py). Traced steps are left out of samples/s")
    return p.parse_args(argv)


def train_samples(args, rank, size, start):
    """This rank's samples for steps start+1 .. --steps. They are drawn in blocks of BLOCK_STEPS
    steps, each block from a seed of its own, so step s reads the same samples whatever --steps is
    and wherever the run started: a resumed run reads exactly what the interrupted one had left.
    With --global-batch-size, one stream for all ranks, each step's global batch split in rank
    order: whatever the number of ranks, no sample is skipped or read twice."""
    shared = bool(args.global_batch_size)
    batch = args.global_batch_size if shared else args.batch_size
    block = BLOCK_STEPS * batch
    first = start // BLOCK_STEPS
    end = max(first + 1, -(-args.steps // BLOCK_STEPS))
    stream = args.seed * 31 + (10_000_000 if shared else rank)
    parts = [criteo_synth.make_dataset(block, seed=args.seed, sample_seed=[stream, b]) for b in range(first, end)]
    steps = max(0, args.steps - start)
    skip, count = start * batch - first * block, steps * batch
    data = {name: np.concatenate([p[name] for p in parts])[skip:skip + count] for name in parts[0]}
    if not shared:
        return data
    local = batch // size
    return {name: a.reshape(steps, batch, *a.shape[1:])[:, rank * local:(rank + 1) * local].reshape(
        steps * local, *a.shape[1:]) for name, a in data.items()}


def feature_specs():
    # One id tensor ("cat", 26 fields) looked up in two tables: dim-1 wide weights and deep embeddings.
    return [FeatureSpec("cat", table_name="deep_table"),
            FeatureSpec("cat_wide", table_name="wide_table", index_key="cat")]


def make_input(data, batch_size, is_training, repeat):
    dataset = tf.data.Dataset.from_tensor_slices(data)
    if repeat:
        dataset = dataset.repeat()
    return pipeline(dataset.batch(batch_size, drop_remainder=True), is_training)


def parquet_input(args, rank, size):
    """--parquet DIR: this rank's samples of the whole run (train_samples from step 0) written once as
    DIR/part-<rank>-of-<ranks>.parquet (under a dot-name, renamed when complete), then the files of
    this rank count read back by ParquetDataset, which deals their row groups to the ranks and keeps
    its position in every checkpoint: a resumed run goes on where the saved step stood."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from mpi4py import MPI

    from shardrec.rank_runtime import ParquetDataset

    name = "part-{:05d}-of-{:05d}.parquet"
    path = os.path.join(args.parquet, name.format(rank, size))
    # What the samples were drawn with, in the file's metadata: a later run with other settings is
    # told so instead of training on data its checkpoint's positions do not describe.
    drawn = json.dumps({"steps": args.steps, "batch_size": args.batch_size, "seed": args.seed,
                        "global_batch_size": args.global_batch_size}, sort_keys=True).encode()
    if not os.path.exists(path):
        os.makedirs(args.parquet, exist_ok=True)
        data = train_samples(args, rank, size, 0)
        columns = {**{f"C{i + 1}": data["cat"][:, i] for i in range(criteo_synth.NUM_CAT)},
                   **{f"I{i + 1}": data["dense"][:, i] for i in range(criteo_synth.NUM_DENSE)}, "label": data["label"]}
        partial = os.path.join(args.parquet, "." + os.path.basename(path))
        table = pa.table(columns).replace_schema_metadata({"wide_deep.samples": drawn})
        pq.write_table(table, partial, row_group_size=BLOCK_STEPS * args.batch_size)
        os.rename(partial, path)
    found = (pq.read_schema(path).metadata or {}).get(b"wide_deep.samples")
    if found != drawn:
        raise SystemExit(f"--parquet: {path} holds samples drawn with {found.decode() if found else 'unknown settings'}, "
                         f"this run asks for {drawn.decode()}: use another directory, or the same settings")
    MPI.COMM_WORLD.Barrier()  # every rank's file is in place before any rank lists them
    kinds = {"cat": ("id", [f"C{i + 1}" for i in range(criteo_synth.NUM_CAT)]),
             "dense": ("float", [f"I{i + 1}" for i in range(criteo_synth.NUM_DENSE)]), "label": "float"}
    files = [os.path.join(args.parquet, name.format(r, size)) for r in range(size)]
    return pipeline(ParquetDataset(files, args.batch_size, kinds, partitions=size), True)


def pipeline(dataset, is_training):
    dataset = dataset.map(get_asc_insert_func(tgt_key_specs=feature_specs(), is_training=is_training))
    dataset = dataset.prefetch(8)
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    return iterator, iterator.get_next()


class DenseTower:
    """The dense layers, built once and called by the train and the eval graph alike."""

    def __init__(self):
        dense = tf.keras.layers.Dense
        self.mlp = [dense(256, tf.nn.relu, name="mlp_1"), dense(128, tf.nn.relu, name="mlp_2"),
                    dense(1, name="mlp_out")]
        self.wide_dense = dense(1, name="wide_dense")

    def __call__(self, deep, wide, dense_in):
        x = tf.concat([tf.reshape(deep, [-1, criteo_synth.NUM_CAT * DEEP_DIM]), dense_in], axis=1)
        for layer in self.mlp:
            x = layer(x)
        return tf.squeeze(x + tf.reduce_sum(wide, axis=1) + self.wide_dense(dense_in), axis=1)


def model_forward(batch, tables, tower, send_count, is_train):
    deep_spec, wide_spec = feature_specs()
    deep_table, wide_table = tables
    deep = sparse_lookup(deep_table, deep_spec, send_count, is_train=is_train, batch=batch,
                         name="deep_table_lookup")                                  # [B, 26, 16]
    wide = sparse_lookup(wide_table, wide_spec, send_count, is_train=is_train, batch=batch,
                         name="wide_table_lookup")                                  # [B, 26, 1]
    logit = tower(deep, wide, batch["dense"])
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=batch["label"], logits=logit))
    return loss, tf.sigmoid(logit)


def serving_model(features):
    """The inference graph from raw features ("cat" ids, "dense" inputs) to "prob", for the export:
    export_saved_model calls it in a graph of its own, where tables are stock lookups filled from
    the checkpoint (so the initializers here are never run). Also the --model-fn of shardrec-export."""
    tables = [create_table(key_dtype=tf.int64, dim=DEEP_DIM, name="deep_table",
                           emb_initializer=tf.compat.v1.zeros_initializer()),
              create_table(key_dtype=tf.int64, dim=1, name="wide_table", emb_initializer=tf.compat.v1.zeros_initializer())]
    deep_spec, wide_spec = feature_specs()
    deep = sparse_lookup(tables[0], deep_spec, batch=features, is_train=False)
    wide = sparse_lookup(tables[1], wide_spec, batch=features, is_train=False)
    return {"prob": tf.sigmoid(DenseTower()(deep, wide, features["dense"]))}


def export_for_serving(checkpoint, export_dir):
    inputs = {"cat": tf.TensorSpec([None, criteo_synth.NUM_CAT], tf.int64),
              "dense": tf.TensorSpec([None, criteo_synth.NUM_DENSE], tf.float32)}
    return export_saved_model(checkpoint, export_dir, serving_model, inputs)


def main(argv=None):
    args = parse_args(argv)
    tf.compat.v1.disable_eager_execution()
    # Keras draws an unseeded layer's initial weights from NumPy's global generator: seeding it too
    # makes a run repeatable (and comparable across launches and hosts).
    tf.keras.utils.set_random_seed(args.seed)
    incremental = {}
    if args.incremental:
        full_s, delta_s = (int(v) for v in args.incremental.split(","))
        incremental = dict(is_incremental_checkpoint=True, save_checkpoint_due_time=full_s,
                           save_delta_checkpoints_secs=delta_s)
    init(use_dynamic=not args.static_shapes, train_steps=args.steps, **incremental)
    rank, size = get_rank_id(), get_rank_size()
    if args.global_batch_size:
        if args.global_batch_size % size:
            raise SystemExit(f"--global-batch-size {args.global_batch_size}: allowed: a multiple of the number of "
                             f"ranks ({size})")
        args.batch_size = args.global_batch_size // size

    # The checkpoint to continue from: the one the supervisor hands a restarted attempt, else the
    # newest complete one of the model directory (a later run of the same job).
    resume = resume_checkpoint() or tf.train.latest_checkpoint(args.model_dir)
    start = int(resume.rsplit("-", 1)[1]) if resume else 0
    if args.parquet:
        train_iterator, train_batch = parquet_input(args, rank, size)
    else:
        train_iterator, train_batch = make_input(train_samples(args, rank, size, start), args.batch_size, True,
                                                 repeat=False)
    eval_data = criteo_synth.make_dataset(args.eval_samples, seed=args.seed, sample_seed=args.seed * 31 + 10_000 + rank)
    eval_iterator, eval_batch = make_input(eval_data, args.batch_size, False, repeat=False)

    dense_optimizer = tf.compat.v1.train.AdamOptimizer(learning_rate=0.001)
    sparse_optimizer = create_hash_optimizer(learning_rate=0.01)

    vocab = int(criteo_synth.vocab_sizes(args.seed).sum())
    init_deep = tf.compat.v1.truncated_normal_initializer(stddev=0.05, seed=args.seed)
    tables = [create_table(key_dtype=tf.int64, dim=tf.TensorShape([DEEP_DIM]), name="deep_table",
                           emb_initializer=init_deep, device_vocabulary_size=vocab, value_dtype=args.value_dtype,
                           slot_dtype=args.slot_dtype),
              create_table(key_dtype=tf.int64, dim=1, name="wide_table",
                           emb_initializer=tf.compat.v1.zeros_initializer(), device_vocabulary_size=vocab)]
    # Static shapes pad each batch's unique keys to send_count: at most every id of the batch.
    send_count = args.batch_size * criteo_synth.NUM_CAT
    tower = DenseTower()
    train_loss, _ = model_forward(train_batch, tables, tower, send_count, is_train=True)
    _, eval_prob = model_forward(eval_batch, tables, tower, send_count, is_train=False)

    dense_variables, sparse_variables = get_dense_and_sparse_variable()
    global_step = tf.compat.v1.train.get_or_create_global_step()
    # One backward pass for both optimizers (docs/guide/training.md); the dense gradients averaged
    # over the ranks as hvd.DistributedOptimizer would.
    grads = tf.gradients(train_loss, dense_variables + sparse_variables)
    dense_grads = grads[:len(dense_variables)]
    if size > 1:
        dense_grads = [hvd.allreduce(g) for g in dense_grads]
    train_op = tf.group(
        dense_optimizer.apply_gradients(zip(dense_grads, dense_variables), global_step=global_step),
        sparse_optimizer.apply_gradients(zip(grads[len(dense_variables):], sparse_variables)))

    saver = tf.compat.v1.train.Saver(max_to_keep=2)
    start_asc_pipeline()

    def evaluate(sess):
        probs, labels = criteo_synth.run_to_end(sess, eval_iterator.initializer, [eval_prob, eval_batch["label"]])
        if args.eval_predictions:
            np.save(f"{args.eval_predictions}-rank{rank}.npy", probs)
        return criteo_synth.auc(labels, probs)

    os.makedirs(args.model_dir, exist_ok=True)
    # One path on every rank: each rank writes its shard under it, rank 0 the dense part.
    ckpt_prefix = os.path.join(args.model_dir, "model")
    with tf.compat.v1.Session() as sess:
        sess.run(train_iterator.initializer)
        sess.run(tf.compat.v1.global_variables_initializer())
        if resume:
            saver.restore(sess, resume)
            log.info("resumed from %s: continuing at step %d of %d", resume, start + 1, args.steps)
        sess.run(hvd.broadcast_variables(dense_variables, root_rank=0))
        window_start, window_steps, losses, step = time.time(), 0, [], start
        # Steady state: the clock runs from after the warm-up steps to the first traced step.
        warmup = start + min(args.warmup_steps, max(0, args.steps - start - args.trace_steps - 1))
        timed_end = args.steps - args.trace_steps
        clock = {}
        shares, timeline = [], StepTimeline()
        exchange = get_world().exchanges[Channel.TRAIN]
        for step in range(start + 1, args.steps + 1):
            if step == warmup + 1:
                clock["start"], clock["exchange"], clock["cpu"] = time.time(), exchange.counters(), time.process_time()
            if step == timed_end + 1:
                clock["end"], clock["exchange_end"], clock["cpu_end"] = time.time(), exchange.counters(), time.process_time()
            try:
                if step > timed_end:
                    metadata = tf.compat.v1.RunMetadata()
                    _, loss = sess.run([train_op, train_loss], options=traced_run_options(), run_metadata=metadata)
                    shares.append(row_exchange_share(metadata, tf.compat.v1.get_default_graph()))
                    timeline.record(metadata)
                else:
                    _, loss = sess.run([train_op, train_loss])
            except tf.errors.OutOfRangeError:
                log.info("end of training data at step %d", step)
                step -= 1
                break
            losses.append(loss)
            window_steps += 1
            report(step=step, loss=loss, total_steps=args.steps)
            if args.save_every and step % args.save_every == 0 and step < args.steps:
                saver.save(sess, ckpt_prefix, global_step=step)
            elif args.incremental and step < args.steps:
                saver.maybe_save(sess, ckpt_prefix, step)
            if step % args.log_every == 0 or step == args.steps:
                rate = window_steps * args.batch_size * size / (time.time() - window_start)
                log.info("step %d/%d  loss %.4f  %.0f samples/s", step, args.steps, np.mean(losses[-window_steps:]), rate)
                window_start, window_steps = time.time(), 0
        if "end" not in clock:
            clock["end"], clock["exchange_end"], clock["cpu_end"] = time.time(), exchange.counters(), time.process_time()
        if "start" not in clock:  # the data ended during the warm-up
            clock["start"], clock["exchange"], clock["cpu"] = clock["end"], clock["exchange_end"], clock["cpu_end"]
        timed_steps = max(0, min(step, timed_end) - warmup)
        if not losses:
            losses = [float("nan")]  # resumed at the last step: nothing left to train
        train_seconds = clock["end"] - clock["start"]
        exchange_s = clock["exchange_end"].seconds_total - clock["exchange"].seconds_total
        collectives_s = clock["exchange_end"].seconds_in_collectives - clock["exchange"].seconds_in_collectives
        if shares:
            n = max(1, timed_steps)
            split = timeline.report(clock["exchange"], clock["exchange_end"], train_seconds / n,
                                    (clock["cpu_end"] - clock["cpu"]) / n)
            if rank == 0:
                log.info("step timeline of the last %d steps, every rank:\n%s", len(shares), split.format())
                print("TIMELINE " + json.dumps(list(split.ranks)), flush=True)
        path = saver.save(sess, ckpt_prefix, global_step=step) if step > start else resume
        auc = evaluate(sess)
    sizes = ", ".join(f"{t.table_name}={t.size()}/{t.global_size()}" for t in tables)
    summary = (f"SUMMARY rank={rank}/{size} steps={step} resumed_from={start} first_loss={np.mean(losses[:20]):.4f} "
               f"final_loss={np.mean(losses[-20:]):.4f} eval_auc={auc:.4f} "
               f"samples_per_s={timed_steps * args.batch_size * size / max(train_seconds, 1e-9):.0f} "
               f"key_exchange_s={exchange_s:.2f} key_collectives_s={collectives_s:.2f} "
               f"train_s={train_seconds:.2f} row_exchange_share={f'{np.median(shares):.3f}' if shares else 'n/a'} "
               f"tables (this rank/all ranks): {sizes} saved={path}")
    print(summary, flush=True)
    if args.export and rank == 0:
        # One process reads every rank's shard of the checkpoint just saved; the others are done.
        export_for_serving(path, args.export)
    terminate_config_initializer()
    return auc


if __name__ == "__main__":
    main()
