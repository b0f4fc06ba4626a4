"""The Criteo-shaped DLRM of examples/dlrm.py trained by shardrec and by its peers on the same
files, the configurations alternating in one run (issue 56):

    python examples/dlrm.py write --out DIR --train-samples 131072
    python bench/dlrm_peers.py --data DIR [--rounds 2] [--ranks 1 2] [--only shardrec shardrec_ungrouped tf_premapped tfra]

Each configuration is a fresh job on `ranks` MPI ranks that prints examples/dlrm.py's SUMMARY line
(samples/s and CPU seconds per 1000 samples over the steps after the warm-up, held-out AUC):

    shardrec parquet / tfrecord   examples/dlrm.py train: ParquetDataset, or TFRecord + parse_example
    shardrec_ungrouped parquet    the same with table groups off (SHARDREC_TABLE_GROUPS=off): each table alone
    tf_premapped                  plain TensorFlow from the Parquet files: one variable a table, sized
                                  by its cardinality, ids mapped to rows in the graph (the generator's
                                  scramble inverted: a vocabulary mapped before training, the best case
                                  TensorFlow has), each table's ids deduped, lazy Adam by scatter ops
                                  (bench/peers.py); on 2 ranks the tables are replicated and each step's
                                  rows and row gradients allgathered (Horovod), the dense gradients
                                  allreduced; compare() runs it on 1 rank only, as a replica of the
                                  26 tables with their Adam slots is 11 GB (a 24 GB machine holds one)
    tfra                          TFRA 0.7.2 dynamic_embedding from the Parquet files as its docs advise:
                                  init_size = the table's cardinality, embedding_lookup_unique, its
                                  optimizer wrapper around Adam (1 rank: TFRA's Horovod layer is Keras only)

The model, batch, optimizers and learning rates are examples/dlrm.py's. Medians over the rounds are
printed as a table, then a JSON line of every run.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import criteo_synth  # noqa: E402
import dlrm  # noqa: E402

SCRAMBLE_INVERSE = pow(2654435761, -1, 2**32)  # criteo_synth._zipf_values multiplies ranks by 2654435761 mod 2^32
SPARSE_LR = 0.01  # examples/dlrm.py's tables (lazy Adam)


def _tf_tables(tf, batch):
    """Per table: its variable (and Adam slots), the distinct rows of the batch and their values."""
    inverse = tf.constant(SCRAMBLE_INVERSE, tf.int64)
    out = []
    for i, (name, card) in enumerate(zip(dlrm.CATEGORICAL, criteo_synth.KAGGLE_CARDINALITIES)):
        with tf.compat.v1.variable_scope(name, reuse=tf.compat.v1.AUTO_REUSE):
            var = tf.compat.v1.get_variable("emb", [card, dlrm.DIM], use_resource=True,
                                            initializer=tf.compat.v1.random_uniform_initializer(-0.05, 0.05, seed=i))
            slots = [tf.compat.v1.get_variable(s, [card, dlrm.DIM], use_resource=True, trainable=False,
                                               initializer=tf.zeros_initializer()) for s in ("m", "v")]
        rows = tf.bitwise.bitwise_and(batch[name] * inverse, 0xFFFFFFFF)
        unique, restore = tf.unique(rows)
        values = tf.gather(var, unique)
        out.append((var, slots, unique, values, tf.gather(values, restore)))
    return out


def _tfra_params(tf):
    import tensorflow_recommenders_addons as tfra

    return [tfra.dynamic_embedding.get_variable(
        name, key_dtype=tf.int64, value_dtype=tf.float32, dim=dlrm.DIM, init_size=card,
        initializer=tf.compat.v1.random_uniform_initializer(-0.05, 0.05, seed=i))
        for i, (name, card) in enumerate(zip(dlrm.CATEGORICAL, criteo_synth.KAGGLE_CARDINALITIES))]


def peer(args):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from peers import lazy_adam_update
    from shardrec.rank_runtime import ParquetDataset

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    tf.compat.v1.disable_eager_execution()
    tf.keras.utils.set_random_seed(args.seed)

    def iterator(split, training):
        data = ParquetDataset(os.path.join(args.data, "parquet", split), args.batch_size, dlrm.PARQUET_COLUMNS,
                              training=False, shard=(rank, size), drop_remainder=training).prefetch(2)
        return tf.compat.v1.data.make_initializable_iterator(data)

    train_it, eval_it = iterator("train", True), iterator("eval", False)
    train_batch, eval_batch = train_it.get_next(), eval_it.get_next()
    towers = dlrm.Towers()
    step_var = tf.compat.v1.train.get_or_create_global_step()
    if args.backend == "tf_premapped":
        tables = _tf_tables(tf, train_batch)
        logit = towers(train_batch["dense"], [t[4] for t in tables])
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=train_batch["label"], logits=logit))
        dense_vars = tf.compat.v1.trainable_variables()
        dense_vars = [v for v in dense_vars if not any(v is t[0] for t in tables)]
        grads = tf.gradients(loss, [t[3] for t in tables] + dense_vars)
        row_grads, dense_grads = grads[:len(tables)], grads[len(tables):]
        updates = []
        with tf.control_dependencies([step_var.assign_add(1)]):
            for (var, (m, v), unique, _, _), g in zip(tables, row_grads):
                g = tf.convert_to_tensor(g)
                if size > 1:
                    every, where = tf.unique(hvd.allgather(unique))
                    g = tf.math.unsorted_segment_sum(hvd.allgather(g), where, tf.size(every)) / size
                    unique = every
                updates.append(lazy_adam_update(var, m, v, unique, g, step_var, lr=SPARSE_LR))
        if size > 1:
            dense_grads = [hvd.allreduce(g) for g in dense_grads]
        train_op = tf.group(updates + [tf.compat.v1.train.AdamOptimizer(args.learning_rate).apply_gradients(
            zip(dense_grads, dense_vars))])
        eval_logit = towers(eval_batch["dense"], [t[4] for t in _tf_tables(tf, eval_batch)])
    else:
        import tensorflow_recommenders_addons as tfra

        if size > 1:
            raise SystemExit("tfra: 1 rank only (its Horovod embedding layer is Keras only)")
        de = tfra.dynamic_embedding
        params = _tfra_params(tf)
        looked = [de.embedding_lookup_unique(p, train_batch[n], name=f"{n}_train", return_trainable=True)
                  for p, n in zip(params, dlrm.CATEGORICAL)]
        logit = towers(train_batch["dense"], [emb for emb, _ in looked])
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=train_batch["label"], logits=logit))
        wrappers = [w for _, w in looked]
        dense_vars = [v for v in tf.compat.v1.trainable_variables() if not any(v is w for w in wrappers)]
        sparse_opt = de.DynamicEmbeddingOptimizer(tf.compat.v1.train.AdamOptimizer(SPARSE_LR))
        # One backward pass for both optimizers, as shardrec's and the pre-mapped model's.
        grads = tf.gradients(loss, wrappers + dense_vars)
        train_op = tf.group(
            sparse_opt.apply_gradients(zip(grads[:len(wrappers)], wrappers)),
            tf.compat.v1.train.AdamOptimizer(args.learning_rate).apply_gradients(
                zip(grads[len(wrappers):], dense_vars), global_step=step_var))
        eval_logit = towers(eval_batch["dense"], [de.embedding_lookup_unique(p, eval_batch[n], name=f"{n}_eval")
                                                  for p, n in zip(params, dlrm.CATEGORICAL)])
    eval_prob = tf.sigmoid(eval_logit)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        if size > 1:
            sess.run(hvd.broadcast_variables(dense_vars, root_rank=0))
        sess.run(train_it.initializer)
        step, clock = 0, None
        while args.steps <= 0 or step < args.steps:
            if step == args.warmup_steps:
                clock = (time.time(), time.process_time(), step)
            try:
                sess.run(train_op)
            except tf.errors.OutOfRangeError:
                break
            step += 1
        end = (time.time(), time.process_time(), step)
        probs, labels = criteo_synth.run_to_end(sess, eval_it.initializer, [eval_prob, eval_batch["label"]])
    timed = end[2] - clock[2] if clock else 0
    cpu = end[1] - clock[1] if clock else 0.0
    with tf.compat.v1.Session() as sess:
        cpu, labels, probs = sess.run([hvd.allreduce(tf.constant(cpu, tf.float64), op=hvd.Sum),
                                       hvd.allgather(tf.constant(labels)), hvd.allgather(tf.constant(probs))])
    samples = timed * args.batch_size * size
    if rank == 0:
        wall = max(end[0] - clock[0], 1e-9) if clock else float("nan")
        print(f"SUMMARY ranks={size} format=parquet steps={step} timed_steps={timed} "
              f"samples_per_s={samples / wall:.0f} cpu_s_per_1k_samples={1000 * cpu / max(samples, 1):.4f} "
              f"eval_auc={criteo_synth.auc(labels, probs):.4f} eval_samples={len(labels)}", flush=True)


def _command(config, ranks, args):
    name, fmt = config
    script = ["examples/dlrm.py", "train", "--format", fmt] if name.startswith("shardrec") else \
        ["bench/dlrm_peers.py", "peer", "--backend", name]
    return [os.path.join(ROOT, ".venv", "bin", "mpiexec"), "--oversubscribe", "-np", str(ranks), sys.executable,
            *script, "--data", args.data, "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--warmup-steps", str(args.warmup_steps)]


def compare(args):
    configs = [("shardrec", "parquet"), ("shardrec_ungrouped", "parquet"), ("shardrec", "tfrecord"),
               ("tf_premapped", "parquet"), ("tfra", "parquet")]
    configs = [c for c in configs if c[0] in args.only] if args.only else configs
    runs = []
    for r in range(args.rounds):
        for ranks in args.ranks:
            for config in configs:
                if not config[0].startswith("shardrec") and ranks > 1:
                    continue  # a replica of every table on each rank: 2 x 11 GB here
                proc = subprocess.run(_command(config, ranks, args), capture_output=True, text=True, cwd=ROOT,
                                      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                                               SHARDREC_TABLE_GROUPS="off" if config[0] == "shardrec_ungrouped"
                                               else os.environ.get("SHARDREC_TABLE_GROUPS", "on")))
                line = next((x for x in proc.stdout.splitlines() if x.startswith("SUMMARY")), None)
                if proc.returncode != 0 or line is None:
                    raise SystemExit(f"{config} on {ranks} rank(s) failed:\n{proc.stderr[-3000:]}")
                fields = dict(re.findall(r"(\w+)=(\S+)", line))
                runs.append({"round": r, "ranks": ranks, "embeddings": config[0], "format": config[1],
                             **{k: float(fields[k]) for k in ("samples_per_s", "cpu_s_per_1k_samples", "eval_auc")}})
                print(f"round {r} ranks {ranks} {config[0]} {config[1]}: {line}", file=sys.stderr, flush=True)
    print("| ranks | embeddings | feed | samples/s | CPU s per 1000 samples | held-out AUC |")
    print("| --- | --- | --- | --- | --- | --- |")
    for ranks in args.ranks:
        for name, fmt in configs:
            mine = [x for x in runs if x["ranks"] == ranks and x["embeddings"] == name and x["format"] == fmt]
            if mine:
                med = {k: statistics.median(x[k] for x in mine) for k in ("samples_per_s", "cpu_s_per_1k_samples",
                                                                         "eval_auc")}
                print(f"| {ranks} | {name} | {fmt} | {med['samples_per_s']:.0f} | {med['cpu_s_per_1k_samples']:.4f} | "
                      f"{med['eval_auc']:.4f} |")
    print(json.dumps({"runs": runs, "command": " ".join(sys.argv)}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="compare", choices=["compare", "peer"])
    p.add_argument("--data", required=True, help="what examples/dlrm.py write --out wrote")
    p.add_argument("--backend", choices=["tf_premapped", "tfra"], help="peer: its embeddings")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--only", nargs="+", help="these embeddings alone: shardrec shardrec_ungrouped tf_premapped tfra")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--steps", type=int, default=0, help="at most this many steps (0: until a rank's data ends)")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--learning-rate", type=float, default=0.001)
    p.add_argument("--seed", type=int, default=2024)
    args = p.parse_args(argv)
    peer(args) if args.mode == "peer" else compare(args)


if __name__ == "__main__":
    main()
