"""DLRM on Criteo Kaggle-shaped data, from Parquet (ParquetDataset) or TFRecord files.

    python examples/dlrm.py write --out DIR [--train-samples N] [--eval-samples N]
    mpiexec -np 2 python examples/dlrm.py train --data DIR [--format parquet|tfrecord] [--steps N]

`write` draws Criteo Kaggle-shaped samples (criteo_synth.make_kaggle_shaped: 13 dense features,
26 categorical ones, each Zipf over its Kaggle cardinality, labels from a planted model) and
writes them twice, as Parquet (DIR/parquet/{train,eval}/) and as TFRecord tf.train.Examples
(DIR/tfrecord/{train,eval}/), columns I1..I13, C1..C26, label and prob (the planted click
probability: the best AUC any model reaches is its AUC on the labels).

`train` is the DLRM of Meta's reference for Kaggle (facebookresearch/dlrm): a bottom MLP
13-512-256-64-16 over the dense features, one table of dim 16 per categorical feature (26,
sized by the Kaggle cardinalities, growing with the ids seen: dynamic expansion), the pairwise dot
products of the 27 vectors (351) beside the bottom MLP's output, a top MLP 367-512-256-1; dense
layers Adam (Horovod's allreduce), tables lazy Adam. Each rank reads its share of the files
(ParquetDataset deals row groups; TFRecord files are dealt file by file). Prints a SUMMARY line:
samples/s and CPU seconds per 1000 samples (all ranks) over the steps after the warm-up, the
held-out AUC and the planted model's, and the bytes all ranks sent each other per step (keys, rows,
gradients: the exchanges' own counters). --sharding-plan auto lets the planner place the tables
(docs/guide/sharding.md).
"""
import argparse
import glob
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import criteo_synth  # noqa: E402

DIM = 16
DENSE = [f"I{i + 1}" for i in range(criteo_synth.NUM_DENSE)]
CATEGORICAL = [f"C{i + 1}" for i in range(criteo_synth.NUM_CAT)]
# ParquetDataset's columns: the dense features stacked as one [B, 13] tensor, an id column a table.
PARQUET_COLUMNS = {"dense": ("float", DENSE), "label": "float", "prob": "float", **{n: "id" for n in CATEGORICAL}}


def write(args):
    """Into a folder beside --out, renamed to it when complete: a run cut short leaves no half set."""
    import shutil

    final, args.out = args.out, args.out.rstrip("/") + ".partial"
    shutil.rmtree(args.out, ignore_errors=True)
    _write(args)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.rename(args.out, final)


def _write(args):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tensorflow as tf

    for split, samples, seed in (("train", args.train_samples, [args.seed, 1]), ("eval", args.eval_samples,
                                                                                  [args.seed, 2])):
        data = criteo_synth.make_kaggle_shaped(samples, seed=args.seed, sample_seed=seed)
        columns = {**{n: data["dense"][:, i] for i, n in enumerate(DENSE)},
                   **{n: data["cat"][:, i] for i, n in enumerate(CATEGORICAL)}, "label": data["label"],
                   "prob": data["prob"]}
        per_file = -(-samples // args.files)
        for kind in ("parquet", "tfrecord"):
            os.makedirs(os.path.join(args.out, kind, split), exist_ok=True)
        for f in range(args.files):
            rows = slice(f * per_file, min(samples, (f + 1) * per_file))
            # Laid out as the reader wants it (docs/guide/input.md, "Laying out files for speed"): required columns (no
            # definition levels), plain encoding, no compression.
            arrays = {n: pa.array(c[rows]) for n, c in columns.items()}
            schema = pa.schema([pa.field(n, a.type, nullable=False) for n, a in arrays.items()])
            pq.write_table(pa.table(arrays, schema=schema),
                           os.path.join(args.out, "parquet", split, f"part-{f:03d}.parquet"),
                           row_group_size=args.row_group_rows, use_dictionary=False, compression="none")
            with tf.io.TFRecordWriter(os.path.join(args.out, "tfrecord", split, f"part-{f:03d}.tfrecord")) as w:
                for r in range(rows.start, rows.stop):
                    feature = {n: tf.train.Feature(float_list=tf.train.FloatList(value=[columns[n][r]]))
                               for n in DENSE + ["label", "prob"]}
                    feature.update({n: tf.train.Feature(int64_list=tf.train.Int64List(value=[columns[n][r]]))
                                    for n in CATEGORICAL})
                    w.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
        print(f"{split}: {samples} samples in {args.files} Parquet and {args.files} TFRecord files", flush=True)


def batches(args, split, batch_size, training, rank, size):
    """{dense: [B, 13], C1..C26, label, prob} batches of this rank's share of the split."""
    import tensorflow as tf

    from shardrec.rank_runtime import ParquetDataset

    if args.format == "parquet":
        return ParquetDataset(os.path.join(args.data, "parquet", split), batch_size, PARQUET_COLUMNS,
                              training=training, drop_remainder=training)
    files = sorted(glob.glob(os.path.join(args.data, "tfrecord", split, "*.tfrecord")))[rank::size]
    spec = {**{n: tf.io.FixedLenFeature([], tf.float32) for n in DENSE + ["label", "prob"]},
            **{n: tf.io.FixedLenFeature([], tf.int64) for n in CATEGORICAL}}
    dataset = tf.data.TFRecordDataset(files).batch(batch_size, drop_remainder=training)

    def parse(records):
        parsed = tf.io.parse_example(records, spec)
        return dict({n: parsed[n] for n in CATEGORICAL + ["label", "prob"]},
                    dense=tf.stack([parsed[n] for n in DENSE], axis=1))
    return dataset.map(parse)


class Towers:
    """The bottom and top MLPs, built once for the train and the eval graph."""

    def __init__(self):
        import tensorflow as tf

        dense = tf.keras.layers.Dense
        self.bottom = [dense(n, tf.nn.relu, name=f"bottom_{n}") for n in (512, 256, 64)] + [
            dense(DIM, tf.nn.relu, name="bottom_out")]
        self.top = [dense(n, tf.nn.relu, name=f"top_{n}") for n in (512, 256)] + [dense(1, name="top_out")]

    def __call__(self, dense_in, embeddings):
        import tensorflow as tf

        x = dense_in
        for layer in self.bottom:
            x = layer(x)
        vectors = tf.stack([x] + embeddings, axis=1)  # [B, 27, DIM]
        dots = tf.matmul(vectors, vectors, transpose_b=True)  # [B, 27, 27]
        n = len(embeddings) + 1
        upper = [i * n + j for i in range(n) for j in range(i + 1, n)]
        pairs = tf.gather(tf.reshape(dots, [-1, n * n]), upper, axis=1)  # [B, 351]
        y = tf.concat([x, pairs], axis=1)
        for layer in self.top:
            y = layer(y)
        return tf.squeeze(y, axis=1)


def train(args):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from mx_rec.optimizers.lazy_adam import create_hash_optimizer
    from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable,
                                       get_rank_id, get_rank_size, init, report, sparse_lookup, start_asc_pipeline,
                                       terminate_config_initializer)
    from shardrec.rank_runtime.pipeline.step_profile import wire_bytes

    tf.compat.v1.disable_eager_execution()
    tf.keras.utils.set_random_seed(args.seed)
    init(use_dynamic=True, use_dynamic_expansion=True, sharding_plan=args.sharding_plan)
    rank, size = get_rank_id(), get_rank_size()
    specs = [FeatureSpec(n, table_name=n) for n in CATEGORICAL]

    def iterator(split, training):
        data = batches(args, split, args.batch_size, training, rank, size)
        if training and args.steps > 0:
            # The pass ends where the data does, on every rank in the same round: a loop that stopped
            # at a step count instead would leave the key pipeline's read-ahead rounds open on
            # one rank while another went on to the next collective.
            data = data.take(args.steps)
        data = data.map(get_asc_insert_func(tgt_key_specs=specs, is_training=training)).prefetch(2)
        return tf.compat.v1.data.make_initializable_iterator(data)

    train_it, eval_it = iterator("train", True), iterator("eval", False)
    tables = [create_table(key_dtype=tf.int64, dim=DIM, name=n, device_vocabulary_size=card,
                           emb_initializer=tf.compat.v1.random_uniform_initializer(-0.05, 0.05, seed=i),
                           exchange_dtype=args.exchange_dtype)
              for i, (n, card) in enumerate(zip(CATEGORICAL, criteo_synth.KAGGLE_CARDINALITIES))]
    towers = Towers()

    def forward(batch, is_train):
        embeddings = [sparse_lookup(t, s, batch=batch, is_train=is_train) for t, s in zip(tables, specs)]
        return towers(batch["dense"], embeddings)

    train_batch, eval_batch = train_it.get_next(), eval_it.get_next()
    logit = forward(train_batch, True)
    loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=train_batch["label"], logits=logit))
    eval_prob = tf.sigmoid(forward(eval_batch, False))
    dense_vars, sparse_vars = get_dense_and_sparse_variable()
    step_var = tf.compat.v1.train.get_or_create_global_step()
    # One backward pass for both optimizers: a dense optimizer's minimize() beside a tf.gradients
    # for the tables would run the top MLP's backward twice (a sixth of this model's step).
    grads = tf.gradients(loss, dense_vars + sparse_vars)
    dense_grads = [hvd.allreduce(g) for g in grads[:len(dense_vars)]] if size > 1 else grads[:len(dense_vars)]
    train_op = tf.group(
        tf.compat.v1.train.AdamOptimizer(args.learning_rate).apply_gradients(
            zip(dense_grads, dense_vars), global_step=step_var),
        create_hash_optimizer(learning_rate=0.01).apply_gradients(zip(grads[len(dense_vars):], sparse_vars)))
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_variables(dense_vars, root_rank=0))
        sess.run(train_it.initializer)
        losses, step, clock = [], 0, None
        while args.steps <= 0 or step < args.steps:
            if step == args.warmup_steps:
                clock = (time.time(), time.process_time(), step, wire_bytes())
            try:
                _, value = sess.run([train_op, loss])
            except tf.errors.OutOfRangeError:
                break
            step += 1
            losses.append(value)
            report(step=step, loss=value)
        end = (time.time(), time.process_time(), step, wire_bytes())
        probs, labels, planted = criteo_synth.run_to_end(sess, eval_it.initializer,
                                                         [eval_prob, eval_batch["label"], eval_batch["prob"]])
    timed = (end[2] - clock[2]) if clock else 0
    sent = hvd.allreduce(tf.constant(float(end[3] - clock[3]) if clock else 0.0, tf.float64), op=hvd.Sum)
    wall = max(end[0] - clock[0], 1e-9) if clock else float("nan")
    cpu = hvd.allreduce(tf.constant((end[1] - clock[1]) if clock else 0.0, tf.float64), op=hvd.Sum)
    gathered = [hvd.allgather(tf.constant(r)) for r in (labels, probs, planted)]
    with tf.compat.v1.Session() as sess:
        cpu, sent, (labels, probs, planted) = sess.run([cpu, sent, gathered])
    samples = timed * args.batch_size * size
    if rank == 0:
        print(f"SUMMARY ranks={size} format={args.format} steps={step} timed_steps={timed} "
              f"samples_per_s={samples / wall:.0f} cpu_s_per_1k_samples={1000 * cpu / max(samples, 1):.4f} "
              f"wire_kb_per_step={sent / 1024 / max(timed, 1):.1f} "
              f"first_loss={np.mean(losses[:20]):.4f} final_loss={np.mean(losses[-20:]):.4f} "
              f"eval_auc={criteo_synth.auc(labels, probs):.4f} planted_auc={criteo_synth.auc(labels, planted):.4f} "
              f"eval_samples={len(labels)}", flush=True)
    terminate_config_initializer()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write Criteo Kaggle-shaped samples as Parquet and TFRecord")
    w.add_argument("--out", required=True)
    w.add_argument("--train-samples", type=int, default=200_000)
    w.add_argument("--eval-samples", type=int, default=20_000)
    w.add_argument("--files", type=int, default=4, help="files of each split and format")
    w.add_argument("--row-group-rows", type=int, default=16384)
    w.add_argument("--seed", type=int, default=2024)
    t = sub.add_parser("train", help="train DLRM on the files `write` wrote")
    t.add_argument("--data", required=True)
    t.add_argument("--format", choices=["parquet", "tfrecord"], default="parquet")
    t.add_argument("--batch-size", type=int, default=2048, help="per rank")
    t.add_argument("--steps", type=int, default=0, help="at most this many steps (0: until a rank's data ends)")
    t.add_argument("--warmup-steps", type=int, default=5, help="steps before the clock starts")
    t.add_argument("--learning-rate", type=float, default=0.001, help="the dense layers' Adam")
    t.add_argument("--seed", type=int, default=2024)
    t.add_argument("--sharding-plan", default=None,
                   help="init(sharding_plan=): 'auto' (the planner places the tables) or a JSON plan's path; "
                        "default: every table row-wise")
    t.add_argument("--exchange-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="create_table(exchange_dtype=): rows and gradients between ranks in 16 bits (half the bytes)")
    args = p.parse_args(argv)
    write(args) if args.command == "write" else train(args)


if __name__ == "__main__":
    main()
