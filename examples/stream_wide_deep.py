"""Online training: the Wide&Deep model learning from a stream of events as they arrive.

    python examples/stream_wide_deep.py demo [--seconds 60] [--rate 2000] [--source redis|directory] [--serve]

runs all of it on this machine (`make stream-demo`): a Redis server of its own (or a directory),
a producer writing click events (criteo_synth's data with event times, the popular ids drifting
every --drift-s seconds), and the training job on 2 ranks under shardrec-run, which prints its
throughput and lag as it goes, saves full checkpoints and deltas on the guide's timers, evicts ids
not seen for --evict-after seconds of event time, keeps --keep checkpoints, and ends (saving) once
the stream has been idle for --idle seconds after the producer stops. With --serve, shardrec-serve
serves the model from its first checkpoint on, following every delta, and a client prints the click
probability of an event with an id that the producer starts sending (as clicks) once the client has
its first answer (examples/serve_while_training.py): the prediction moves as the stream teaches the model.

The two halves on their own, for a stream of your own:

    python examples/stream_wide_deep.py produce --broker redis://HOST:6379/0 --name events --partitions 4
    shardrec-run -np 2 --checkpoint-dir MODEL -- python examples/stream_wide_deep.py train \\
        --broker redis://HOST:6379/0 --name events --partitions 4 --model-dir MODEL

A producer of your own appends events to stream `<name>:<partition>`, as this one does several at
a time, `XADD <name>:<p> * records <the bytes of a TFRecord file of them>` (pack_records), or one
at a time, `XADD <name>:<p> * record <event>`; an event is a serialized tf.train.Example with cat
(26 int64), dense (13 float), label, ts (int64 seconds). With --directory it renames complete
TFRecord files into DIR/<partition>/. Stop the
job with SIGTERM to shardrec-run (or Ctrl-C): every rank finishes its step and saves; started
again it resumes every partition where that checkpoint stood.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import criteo_synth  # noqa: E402

EVENT_FIELDS = "cat (26 int64), dense (13 float32), label (float32), ts (int64 seconds)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["demo", "produce", "train"])
    p.add_argument("--broker", help="a Redis URL (the demo starts a server of its own)")
    p.add_argument("--name", default="events", help="the streams are <name>:0 .. <name>:<partitions - 1>")
    p.add_argument("--directory", help="a directory stream instead of Redis (DIR/<partition>/*.tfrecord)")
    p.add_argument("--source", choices=["redis", "directory"], default="redis", help="demo: the stream to use")
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--seconds", type=float, default=60.0, help="produce / demo: how long the producer writes")
    p.add_argument("--rate", type=float, default=2000.0, help="produce / demo: events per second")
    p.add_argument("--drift-s", type=float, default=15.0, help="produce: seconds between shifts of the popular ids")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--model-dir", default="stream-model")
    p.add_argument("--batch-size", type=int, default=256, help="train: per-rank batch size")
    p.add_argument("--idle", type=float, default=15.0, help="train: seconds without new events before the job "
                                                           "saves and ends (0: never; stop it with SIGTERM)")
    p.add_argument("--incremental", default="60,10", metavar="FULL_S,DELTA_S",
                   help="train: a full checkpoint every FULL_S seconds and a delta every DELTA_S (the guide's "
                        "save_checkpoint_due_time and save_delta_checkpoints_secs)")
    p.add_argument("--evict-after", type=int, default=20, help="train: evict ids unseen for this many seconds of "
                                                               "event time")
    p.add_argument("--evict-every", type=int, default=50, help="train: steps between evictions (EvictHook)")
    p.add_argument("--admit-after", type=int, default=1, help="train: events of an id before it gets a row")
    p.add_argument("--keep", type=int, default=3, help="train: checkpoints kept (max_to_keep)")
    p.add_argument("--work", help="demo: its folder (broker data, events, model, logs), emptied first; default: a "
                                  "new temporary folder, which the demo prints and leaves for you to look at")
    p.add_argument("--serve", action="store_true", help="demo: also serve the model while it trains "
                   "(shardrec-serve, examples/serve_while_training.py) and show a new id's prediction change")
    p.add_argument("--new-id-from", metavar="FILE", help="produce: once FILE exists, a quarter of the events "
                   "carry a new id, as clicks (demo --serve: once the client has its first answer)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The producer.

def events(args, chunk, epoch):
    """One chunk of events: criteo_synth's samples, whose non-informative fields' ids shift with
    the epoch (which ids are popular drifts), stamped with the time they are produced."""
    data = criteo_synth.make_dataset(len(chunk), seed=args.seed, sample_seed=[args.seed, int(chunk[0])])
    cat = data["cat"]
    for f in range(criteo_synth.NUM_CAT):
        if f not in criteo_synth.INFORMATIVE_FIELDS:
            low = (cat[:, f] & 0xFFFFFFFF) + np.int64(epoch) * 0x9E3779B1
            cat[:, f] = (np.int64(f) << 32) | (low % (1 << 32))
    return data, int(time.time())


def serialize(data, ts):
    import tensorflow as tf

    feature = tf.train.Feature
    out = []
    for cat, dense, label in zip(data["cat"], data["dense"], data["label"]):
        out.append(tf.train.Example(features=tf.train.Features(feature={
            "cat": feature(int64_list=tf.train.Int64List(value=cat)),
            "dense": feature(float_list=tf.train.FloatList(value=dense)),
            "label": feature(float_list=tf.train.FloatList(value=[label])),
            "ts": feature(int64_list=tf.train.Int64List(value=[ts]))})).SerializeToString())
    return out


class RedisSink:
    def __init__(self, url, name):
        import redis

        self.client, self.name = redis.Redis.from_url(url), name

    def write(self, partition, chunk_number, records):
        from shardrec.rank_runtime import pack_records

        # One entry for the chunk: a record an entry costs the broker and the trainer an entry's work each.
        self.client.xadd(f"{self.name}:{partition}", {"records": pack_records(records)})


class DirectorySink:
    def __init__(self, root):
        self.root = root

    def write(self, partition, chunk_number, records):
        import tensorflow as tf

        folder = os.path.join(self.root, str(partition))
        os.makedirs(folder, exist_ok=True)
        name = f"events-{chunk_number:08d}.tfrecord"
        with tf.io.TFRecordWriter(os.path.join(folder, "." + name)) as w:
            for record in records:
                w.write(record)
        os.rename(os.path.join(folder, "." + name), os.path.join(folder, name))  # complete when it appears


def produce(args):
    """Writes --rate events a second for --seconds, in chunks of half a second, the same number to
    every partition; prints how many. With --new-id-from, the --seconds count from when that file
    appears (the demo's client had its first answer; at most 10 minutes are waited for it)."""
    sink = DirectorySink(args.directory) if args.directory else RedisSink(args.broker, args.name)
    per_chunk = max(args.partitions, int(args.rate / 2) // args.partitions * args.partitions)
    start, written, number = time.time(), 0, 0
    new_id_since = None if args.new_id_from else start
    while time.time() - (new_id_since or start) < (args.seconds if new_id_since else 600):
        data, ts = events(args, np.arange(written, written + per_chunk), int((time.time() - start) // args.drift_s))
        if args.new_id_from is not None and os.path.exists(args.new_id_from):
            from serve_while_training import with_new_id

            new_id_since = new_id_since or time.time()
            data = with_new_id(data)
        records = serialize(data, ts)
        for p in range(args.partitions):
            sink.write(p, number, records[p::args.partitions])
        written, number = written + per_chunk, number + 1
        time.sleep(max(0.0, start + number * per_chunk / args.rate - time.time()))
    print(f"PRODUCED {written} events in {time.time() - start:.1f} s", flush=True)
    return written


# ---------------------------------------------------------------------------------------------
# The training job (every rank runs it).

def train(args):
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import wide_deep
    from mx_rec.core.asc.feature_spec import FeatureSpec
    from mx_rec.core.asc.helper import get_asc_insert_func
    from mx_rec.core.asc.manager import start_asc_pipeline
    from mx_rec.core.embedding import create_table
    from mx_rec.core.feature_process import EvictHook
    from mx_rec.optimizers.lazy_adam import create_hash_optimizer
    from mx_rec.util.initialize import get_rank_id, init
    from mx_rec.util.variable import get_dense_and_sparse_variable
    from shardrec.rank_runtime import DirectoryStream, RedisStream, report

    tf.compat.v1.disable_eager_execution()
    tf.keras.utils.set_random_seed(args.seed)
    full_s, delta_s = (int(v) for v in args.incremental.split(","))
    init(is_incremental_checkpoint=True, save_checkpoint_due_time=full_s, save_delta_checkpoints_secs=delta_s)
    idle = args.idle or None
    stream = (DirectoryStream(args.directory, args.partitions, idle_timeout_s=idle) if args.directory else
              RedisStream(args.broker, args.name, args.partitions, idle_timeout_s=idle))
    columns = {"cat": tf.io.FixedLenFeature([criteo_synth.NUM_CAT], tf.int64),
               "dense": tf.io.FixedLenFeature([criteo_synth.NUM_DENSE], tf.float32),
               "label": tf.io.FixedLenFeature([], tf.float32), "ts": tf.io.FixedLenFeature([], tf.int64)}
    # Admission counts every id (an id gets its row at its --admit-after'th event); eviction needs it.
    thresholds = dict(access_threshold=args.admit_after, eviction_threshold=args.evict_after)
    specs = [FeatureSpec("cat", table_name="deep_table", **thresholds),
             FeatureSpec("cat_wide", table_name="wide_table", index_key="cat", **thresholds),
             FeatureSpec("ts", is_timestamp=True)]
    dataset = stream.dataset().batch(args.batch_size).map(lambda r: tf.io.parse_example(r, columns))
    dataset = dataset.map(get_asc_insert_func(tgt_key_specs=specs, is_training=True)).prefetch(4)
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    vocab = int(criteo_synth.vocab_sizes(args.seed).sum())
    tables = [create_table(key_dtype=tf.int64, dim=wide_deep.DEEP_DIM, name="deep_table",
                           emb_initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.05, seed=args.seed),
                           device_vocabulary_size=vocab),
              create_table(key_dtype=tf.int64, dim=1, name="wide_table",
                           emb_initializer=tf.compat.v1.zeros_initializer(), device_vocabulary_size=vocab)]
    loss, _ = wide_deep.model_forward(batch, tables, wide_deep.DenseTower(), None, is_train=True)
    dense_variables, sparse_variables = get_dense_and_sparse_variable()
    step = tf.compat.v1.train.get_or_create_global_step()
    dense_optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.AdamOptimizer(learning_rate=0.001))
    train_op = tf.group(dense_optimizer.minimize(loss, var_list=dense_variables, global_step=step),
                        create_hash_optimizer(learning_rate=0.01).apply_gradients(
                            zip(tf.gradients(loss, sparse_variables), sparse_variables)))
    start_asc_pipeline()
    hooks = [hvd.BroadcastGlobalVariablesHook(0), EvictHook(evict_step_interval=args.evict_every, evict_time_interval=None)]
    scaffold = tf.compat.v1.train.Scaffold(saver=tf.compat.v1.train.Saver(max_to_keep=args.keep))
    # Every rank is a chief: each writes its shard of the tables (rank 0 the dense part), at the
    # steps the ranks agree on (the incremental timers); the last save comes when the input ends.
    with tf.compat.v1.train.MonitoredTrainingSession(
            checkpoint_dir=args.model_dir, is_chief=True, save_checkpoint_secs=delta_s, scaffold=scaffold,
            save_summaries_steps=None, save_summaries_secs=None, log_step_count_steps=None, hooks=hooks) as sess:
        at = None
        while not sess.should_stop():
            _, value, at = sess.run([train_op, loss, step])
            report(step=at, loss=value)
    print(f"TRAINED rank={get_rank_id()} records={stream.cursor.records_trained} (this attempt) last_step={at}",
          flush=True)


# ---------------------------------------------------------------------------------------------
# Both, on this machine.

def demo(args):
    from shardrec.launch.redis_server import RedisServer

    if args.work:
        work = os.path.abspath(args.work)
        shutil.rmtree(work, ignore_errors=True)
        os.makedirs(work)
    else:  # never the checkout, nor wherever the demo happens to run
        work = tempfile.mkdtemp(prefix="shardrec-stream-demo-")
    print(f"[demo] its folder (broker data, events, model, logs): {work}", flush=True)
    model = os.path.join(work, "model")
    me = [sys.executable, os.path.abspath(__file__)]
    common = ["--partitions", str(args.partitions), "--seed", str(args.seed)]
    server = None
    if args.source == "redis":
        server = RedisServer(os.path.join(work, "redis")).start()
        where = ["--broker", server.url, "--name", args.name]
        print(f"[demo] Redis server at {server.url} (data in {work}/redis)", flush=True)
    else:
        where = ["--directory", os.path.join(work, "events")]
    run = os.path.join(os.path.dirname(sys.executable), "shardrec-run")
    env = dict(os.environ, SHARDREC_PROGRESS_S=os.environ.get("SHARDREC_PROGRESS_S", "5"))
    try:
        new_id = ["--new-id-from", os.path.join(work, "new-id")] if args.serve else []
        producer = subprocess.Popen([*me, "produce", *where, *common, "--seconds", str(args.seconds),
                                     "--rate", str(args.rate), "--drift-s", str(args.drift_s), *new_id],
                                    stdout=subprocess.PIPE, text=True)
        print(f"[demo] producing {args.rate:.0f} events/s for {args.seconds:.0f} s into {args.partitions} "
              "partitions; training on 2 ranks (progress lines: samples/s and each partition's lag)", flush=True)
        trainer = subprocess.Popen([run, "-np", "2", "--checkpoint-dir", model, "--run-dir", os.path.join(work, "run"),
                                    "--", *me, "train", *where, *common, "--model-dir", model,
                                    "--batch-size", str(args.batch_size), "--idle", str(args.idle),
                                    "--incremental", args.incremental, "--evict-after", str(args.evict_after),
                                    "--admit-after", str(args.admit_after), "--evict-every", str(args.evict_every),
                                    "--keep", str(args.keep)], env=env, stdout=subprocess.PIPE, text=True)
        if args.serve:
            from serve_while_training import serve_until_done

            trainer_out, served = serve_until_done(trainer, model, work, args.seed)
        else:
            trainer_out, served = trainer.communicate()[0], None
        produced_text = producer.communicate()[0]
        trained = trained_records(model, os.path.join(work, "events") if server is None else None,
                                  None if server is None else (server.url, args.name))
    finally:
        if server is not None:
            server.stop()
    sys.stdout.write(trainer_out)
    if served is not None:
        print(served, flush=True)
    produced = int(produced_text.split()[1]) if produced_text.startswith("PRODUCED") else -1
    kept = sorted(n for n in os.listdir(model) if n.startswith("sparse-")) if os.path.isdir(model) else []
    print(f"STREAM-DEMO produced={produced} trained={trained} exit={trainer.returncode} "
          f"checkpoints_kept={len(kept)} ({', '.join(kept)})", flush=True)
    return 0 if trainer.returncode == 0 and produced == trained else 1  # every event trained, once


def trained_records(model, events_dir=None, stream=None):
    """The records the latest checkpoint of `model` holds, from the stream positions every rank's
    shard records. A directory's position is a file and the records of it trained; a Redis one
    (stream: its url and name) the last entry trained and the records of the next one trained."""
    import tensorflow as tf

    from shardrec.rank_runtime.formats.sparse_checkpoint import find_shards, read_manifest, sparse_dir
    from shardrec.rank_runtime.stream.tfrecord_files import count_records

    latest = tf.train.latest_checkpoint(model)
    if latest is None:
        return 0
    shards, _ = find_shards(sparse_dir(latest))
    total = 0
    for folder in shards.values():
        for partition, at in read_manifest(folder).stream.partitions.items():
            if stream is not None:
                total += redis_records_before(*stream, partition, at)
                continue
            names = sorted(n for n in os.listdir(os.path.join(events_dir, partition)) if not n.startswith("."))
            total += at.offset + sum(count_records(os.path.join(events_dir, partition, n), partition)
                                     for n in names if at.file is not None and n < at.file)
    return total


def redis_records_before(url, name, partition, at):
    """The records of a Redis partition up to a position: its entries to `at.file`, each one record
    or a packed entry's count, and `at.within` of the next."""
    import redis

    from shardrec.native import framing

    if at.file is None:
        return at.within
    entries = redis.Redis.from_url(url).xrange(f"{name}:{partition}", "-", at.file)
    return at.within + sum(len(framing.frame_tfrecords([fields[b"records"]]).starts) if b"records" in fields else 1
                           for _, fields in entries)


def main(argv=None):
    args = parse_args(argv)
    if args.mode == "demo":
        return demo(args)
    if not args.broker and not args.directory:
        raise SystemExit(f"{args.mode}: give --broker URL (Redis) or --directory DIR")
    return produce(args) and 0 if args.mode == "produce" else train(args)


if __name__ == "__main__":
    sys.exit(main())
