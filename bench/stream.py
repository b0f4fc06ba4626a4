"""Training from a stream against the same records read from files once, the lag under a producer
at 80% of training speed, and what the metrics endpoint costs.

    python bench/stream.py [--records 160000] [--partitions 4] [--batch 1024] [--rounds 3] [--live-s 30]
    python bench/stream.py --only-live directory|redis|redis-packed --speed SAMPLES_PER_S [--live-s 40]
    python bench/stream.py --only-readers [--records 160000] [--rounds 3]

One rank trains the Wide&Deep demo's model (examples/stream_wide_deep.py: 26 ids a sample in two
tables, lazy Adam, the dense tower) on the same serialized tf.train.Example records, fed four ways,
each in a process of its own, the four in turns for --rounds rounds (alternating cancels the
machine's drift):
  files      tf.data.TFRecordDataset over the partitions' files, read once (the baseline)
  directory  DirectoryStream over the same files
  redis      RedisStream over the same records in a Redis server of this machine's own, a record an entry
  redis-packed  the same, --pack records an entry (pack_records), as a producer that batches writes
  metrics    files, with the Prometheus endpoint on and this process scraping it every second
Each reports samples/s and CPU seconds per 1000 samples (process time, all threads) over its
steady steps; the metrics run also times its own costs alone (CPU per batch of the counters, per
scrape of the endpoint), since two runs differ by more than the 1% asked of them. Then the lag: a
producer here appends to Redis at 80% of the redis-packed rounds' median speed for --live-s
seconds while a job trains from it with the endpoint on (a packed entry a partition every 0.1 s),
the same a record an entry at 80% of the redis rounds' speed, and the same with a directory
stream (a file a partition every 0.1 s, at 80% of the directory rounds' speed); the endpoint's
lag is read every half second. Prints one JSON line. BENCH_KEEP_LOGS=1 keeps each job's log
(/tmp/shardrec-bench-<config>-*.log), which is otherwise read only when the job fails.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))
CONFIGS = ("files", "directory", "redis", "redis-packed", "metrics")
WARMUP_STEPS = 10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=160_000)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pack", type=int, default=256, help="records a packed Redis entry holds (redis-packed)")
    p.add_argument("--live-s", type=float, default=30.0)
    p.add_argument("--child", choices=CONFIGS + ("live", "live-directory"), help=argparse.SUPPRESS)
    p.add_argument("--only-live", choices=("directory", "redis", "redis-packed"),
                   help="one lag run alone, at 80%% of --speed samples/s")
    p.add_argument("--only-readers", action="store_true",
                   help="the readers alone: CPU per record of each feed's dataset, batched, no training")
    p.add_argument("--speed", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--broker", help=argparse.SUPPRESS)
    p.add_argument("--name", default="bench", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# One job (a child process).

def child(args):
    import tensorflow as tf

    import criteo_synth
    import wide_deep
    from mx_rec.core.asc.feature_spec import FeatureSpec
    from mx_rec.core.asc.helper import get_asc_insert_func
    from mx_rec.optimizers.lazy_adam import create_hash_optimizer
    from shardrec.rank_runtime import (DirectoryStream, RedisStream, create_table, get_dense_and_sparse_variable, init,
                                       start_asc_pipeline, start_metrics_server)

    tf.compat.v1.disable_eager_execution()
    init()
    if args.child in ("directory", "redis", "redis-packed", "live", "live-directory"):
        stream = (DirectoryStream(args.data, args.partitions, idle_timeout_s=3.0 if args.child == "live-directory"
                                  else 1.0, poll_s=0.05)
                  if args.child in ("directory", "live-directory") else
                  RedisStream(args.broker, args.name, args.partitions, idle_timeout_s=3.0 if args.child == "live"
                              else 1.0, poll_s=0.05))
        records = stream.dataset()
    else:
        records = tf.data.TFRecordDataset(files_in_order(args.data, args.partitions))
    if args.port:
        start_metrics_server(args.port)
    columns = {"cat": tf.io.FixedLenFeature([criteo_synth.NUM_CAT], tf.int64),
               "dense": tf.io.FixedLenFeature([criteo_synth.NUM_DENSE], tf.float32),
               "label": tf.io.FixedLenFeature([], tf.float32)}
    specs = [FeatureSpec("cat", table_name="deep_table"), FeatureSpec("cat_wide", table_name="wide_table",
                                                                      index_key="cat")]
    dataset = records.batch(args.batch).map(lambda r: tf.io.parse_example(r, columns))
    dataset = dataset.map(get_asc_insert_func(tgt_key_specs=specs, is_training=True)).prefetch(4)
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    vocab = int(criteo_synth.vocab_sizes(0).sum())
    tables = [create_table(key_dtype=tf.int64, dim=wide_deep.DEEP_DIM, name="deep_table",
                           emb_initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.05, seed=1),
                           device_vocabulary_size=vocab),
              create_table(key_dtype=tf.int64, dim=1, name="wide_table",
                           emb_initializer=tf.compat.v1.zeros_initializer(), device_vocabulary_size=vocab)]
    loss, _ = wide_deep.model_forward(batch, tables, wide_deep.DenseTower(), None, is_train=True)
    dense, sparse = get_dense_and_sparse_variable()
    train_op = tf.group(tf.compat.v1.train.AdamOptimizer(0.001).minimize(loss, var_list=dense),
                        create_hash_optimizer(0.01).apply_gradients(zip(tf.gradients(loss, sparse), sparse)))
    start_asc_pipeline()
    steps, marks = 0, []
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        print("READY", flush=True)
        while True:
            try:
                sess.run(train_op)
            except tf.errors.OutOfRangeError:
                break
            steps += 1
            marks.append((time.perf_counter(), time.process_time()))
        # Steady steps: after the warm-up, before the last two (a stream's idle wait ends the data).
        first, last = marks[WARMUP_STEPS], marks[-3]
        samples = (len(marks) - 3 - WARMUP_STEPS) * args.batch
        out = {"config": args.child, "steps": steps, "samples_per_s": samples / (last[0] - first[0]),
               "cpu_s_per_1000": 1000 * (last[1] - first[1]) / samples}
        if args.child == "metrics":
            out.update(metrics_cost(tables, (last[1] - first[1]) / (len(marks) - 3 - WARMUP_STEPS)))
        if args.child.startswith("live"):
            out["records"] = stream.cursor.records_trained
    print(json.dumps(out), flush=True)


def metrics_cost(tables, step_cpu_s):
    """What the metrics cost, timed alone in CPU time (the samples/s of two runs differ by more than
    the 1% asked of it): the per-batch counters (metrics.batch_trained) against a step, and one
    scrape's collection and text (what the endpoint does per request) against a second."""
    from prometheus_client import CollectorRegistry, generate_latest

    from shardrec.rank_runtime.process import metrics

    calls = 2000
    begin = time.process_time()
    for _ in range(calls):
        metrics.batch_trained(0, tables)
    per_batch = (time.process_time() - begin) / calls
    registry = CollectorRegistry()
    registry.register(metrics._Collector(0))
    begin = time.process_time()
    for _ in range(50):
        generate_latest(registry)
    per_scrape = (time.process_time() - begin) / 50
    return {"metrics_us_per_batch": per_batch * 1e6, "metrics_ms_per_scrape": per_scrape * 1e3,
            "step_cpu_ms": step_cpu_s * 1e3,
            "metrics_cost_share": per_batch / step_cpu_s + per_scrape / 1.0}


def files_in_order(root, partitions):
    """The partitions' files in the order a stream of one rank reads them: a file of each in turn."""
    lists = [sorted(os.listdir(os.path.join(root, str(p)))) for p in range(partitions)]
    return [os.path.join(root, str(p), lists[p][i]) for i in range(max(map(len, lists)))
            for p in range(partitions) if i < len(lists[p])]


# ---------------------------------------------------------------------------------------------
# The runs (this process).

def records(count, seed=0):
    from stream_wide_deep import serialize

    import criteo_synth

    out = []
    for start in range(0, count, 10_000):
        data = criteo_synth.make_dataset(min(10_000, count - start), seed=0, sample_seed=[seed, start])
        out += serialize(data, 0)
    return out


def write(root, broker_url, name, serialized, partitions, pack, per_file=10_000):
    import redis
    import tensorflow as tf

    from shardrec.rank_runtime import pack_records

    client = redis.Redis.from_url(broker_url)
    for p in range(partitions):
        mine = serialized[p::partitions]
        os.makedirs(os.path.join(root, str(p)))
        for f, start in enumerate(range(0, len(mine), per_file)):
            with tf.io.TFRecordWriter(os.path.join(root, str(p), f"events-{f:05d}.tfrecord")) as w:
                for record in mine[start:start + per_file]:
                    w.write(record)
        for start in range(0, len(mine), 5000):
            pipe = client.pipeline(transaction=False)
            for record in mine[start:start + 5000]:
                pipe.xadd(f"{name}:{p}", {"record": record})
            pipe.execute()
        for start in range(0, len(mine), pack):
            client.xadd(f"{name}-packed:{p}", {"records": pack_records(mine[start:start + pack])})


def run_child(args, config, data, url, name="bench", port=0, on_ready=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--data", data, "--broker", url,
           "--name", name, "--partitions", str(args.partitions), "--batch", str(args.batch), "--port", str(port)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    with tempfile.NamedTemporaryFile("w+", prefix=f"shardrec-bench-{config}-", suffix=".log",
                                     delete=not os.environ.get("BENCH_KEEP_LOGS")) as err:  # read if it fails
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT)
        result = None
        for line in proc.stdout:
            if line.startswith("READY") and on_ready is not None:
                on_ready()
            if line.startswith("{"):
                result = json.loads(line)
        if proc.wait() != 0 or result is None:
            err.seek(0)
            raise RuntimeError(f"{config}: exit {proc.returncode}\n{err.read()[-3000:]}")
    return result


def scrape_every(port, seconds, stop, seen):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    while not stop.is_set():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                families = list(text_string_to_metric_families(r.read().decode()))
            seen.append((time.monotonic(), families))
        except OSError:
            pass
        stop.wait(seconds)


class RedisProducer:
    """A record an entry, or (packed) an entry a partition per call."""

    def __init__(self, url, partitions, name, packed):
        import redis

        self.client, self.partitions, self.name, self.packed = redis.Redis.from_url(url), partitions, name, packed

    def write(self, records, first):
        from shardrec.rank_runtime import pack_records

        pipe = self.client.pipeline(transaction=False)
        if self.packed:
            for p in range(self.partitions):
                mine = records[(p - first) % self.partitions::self.partitions]
                if mine:
                    pipe.xadd(f"{self.name}:{p}", {"records": pack_records(mine)})
        else:
            for i, record in enumerate(records, first):
                pipe.xadd(f"{self.name}:{i % self.partitions}", {"record": record})
        pipe.execute()


class FileProducer:
    """A file a partition per call, written under a dot-name and renamed into place."""

    def __init__(self, root, partitions):
        self.root, self.partitions, self.files = root, partitions, 0
        for p in range(partitions):
            os.makedirs(os.path.join(root, str(p)), exist_ok=True)

    def write(self, records, first):
        import tensorflow as tf

        for p in range(self.partitions):
            name = f"live-{self.files:06d}.tfrecord"
            tmp = os.path.join(self.root, str(p), "." + name)
            with tf.io.TFRecordWriter(tmp) as w:
                for i in range(p - first % self.partitions, len(records), self.partitions):
                    if i >= 0:
                        w.write(records[i])
            os.rename(tmp, os.path.join(self.root, str(p), name))
        self.files += 1


def live(args, config, where, producer, serialized, speed):
    """`producer` writes at 80% of `speed` for --live-s seconds while a job trains from `where`
    (config "live": Redis, the producer's stream; "live-directory": a directory); the lag its
    endpoint reports."""
    from shardrec.launch.redis_server import free_port

    rate, port = 0.8 * speed, free_port()
    started, stop, seen = threading.Event(), threading.Event(), []
    name = getattr(producer, "name", "live")
    job = threading.Thread(target=lambda: seen.append(run_child(args, config, where, where, name, port,
                                                                started.set)))
    job.start()
    started.wait(300)
    scraper = threading.Thread(target=scrape_every, args=(port, 0.5, stop, seen))
    scraper.start()
    begin, sent = time.monotonic(), 0
    while time.monotonic() - begin < args.live_s:
        due = int(rate * (time.monotonic() - begin)) - sent
        if due > 0:
            producer.write([serialized[i % len(serialized)] for i in range(sent, sent + due)], sent)
            sent += due
        time.sleep(0.1)
    job.join(600)
    stop.set()
    scraper.join()
    lags, seconds = [], []
    for at, families in (s for s in seen if isinstance(s, tuple)):
        if at - begin < 5 or at - begin > args.live_s:  # the job's first batches; the catch-up after
            continue
        for family in families:
            if family.name == "shardrec_stream_lag_records":
                lags.append(sum(s.value for s in family.samples))
            if family.name == "shardrec_stream_lag_seconds":
                seconds.append(max([s.value for s in family.samples] or [0]))
    half = len(lags) // 2
    trained = next(s for s in seen if isinstance(s, dict))["records"]
    return {"producer_per_s": rate, "produced": sent, "trained": trained, "lag_records_max": max(lags or [0]),
            "lag_records_median_first_half": statistics.median(lags[:half] or [0]),
            "lag_records_median_second_half": statistics.median(lags[half:] or [0]),
            "lag_seconds_max": max(seconds or [0]), "lag_seconds_median": statistics.median(seconds or [0]),
            "scrapes": len(lags)}


def readers(args, root, url):
    """CPU microseconds a record of each feed's records alone (batched, no model), the feeds in
    turns in this process: what reading costs the trainer, without the training's noise."""
    import tensorflow as tf

    from shardrec.rank_runtime.formats.stream_positions import PartitionPosition
    from shardrec.rank_runtime.stream import RedisStream
    from shardrec.rank_runtime.stream.cursor import StreamCursor

    def stream(name):
        s = RedisStream(url, name, args.partitions, idle_timeout_s=0.01, poll_s=0.01)
        s.owned, s.cursor = list(s.names), StreamCursor({p: PartitionPosition(None, 0) for p in s.names})
        s._prepare()
        return s._records()

    feeds = {"files": lambda: tf.data.TFRecordDataset(files_in_order(root, args.partitions)),
             "redis": lambda: stream("bench"), "redis-packed": lambda: stream("bench-packed")}
    out = {name: [] for name in feeds}
    for _ in range(args.rounds):
        for name, make in feeds.items():
            begin, n = time.process_time(), 0
            for batch in make().batch(args.batch):
                n += int(batch.shape[0])
            out[name].append((time.process_time() - begin) / n * 1e6)
    return {name: {"cpu_us_per_record": statistics.median(v), "rounds": v} for name, v in out.items()}


def paired(runs, config, figure):
    return statistics.median(a[figure] / b[figure] for a, b in zip(runs[config], runs["files"]))


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    from shardrec.launch.redis_server import RedisServer, free_port

    work = tempfile.mkdtemp(prefix="shardrec-bench-stream-")
    try:
        with RedisServer(os.path.join(work, "redis"), fsync="everysec") as server:
            serialized = records(args.records)
            if args.only_live:  # one lag run alone, the producer at 80% of --speed
                root = os.path.join(work, "live")
                producer = FileProducer(root, args.partitions) if args.only_live == "directory" else \
                    RedisProducer(server.url, args.partitions, "live", args.only_live == "redis-packed")
                print(json.dumps({f"live_{args.only_live}": live(
                    args, "live-directory" if args.only_live == "directory" else "live",
                    root if args.only_live == "directory" else server.url, producer, serialized, args.speed)}),
                    flush=True)
                return
            write(os.path.join(work, "events"), server.url, "bench", serialized, args.partitions, args.pack)
            if args.only_readers:
                print(json.dumps({"readers": readers(args, os.path.join(work, "events"), server.url)}), flush=True)
                return
            runs = {c: [] for c in CONFIGS}
            for r in range(args.rounds):
                for config in CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]:
                    stop, seen = threading.Event(), []
                    port = free_port() if config == "metrics" else 0
                    scraper = threading.Thread(target=scrape_every, args=(port, 1.0, stop, seen)) if port else None
                    result = run_child(args, config, os.path.join(work, "events"), server.url,
                                       "bench-packed" if config == "redis-packed" else "bench", port=port,
                                       on_ready=scraper.start if scraper else None)
                    stop.set()
                    if scraper:
                        scraper.join()
                        result["scrapes"] = len(seen)
                    runs[config].append(result)
                    print(f"round {r}: {json.dumps(result)}", file=sys.stderr, flush=True)
            med = {c: {k: statistics.median(x[k] for x in runs[c]) for k in ("samples_per_s", "cpu_s_per_1000")}
                   for c in CONFIGS}
            out = {"records": args.records, "batch": args.batch, "partitions": args.partitions, "rounds": runs,
                   "median": med,
                   # Each round's runs ran back to back: the median of the rounds' own ratios.
                   "directory_vs_files": paired(runs, "directory", "samples_per_s"),
                   "redis_vs_files": paired(runs, "redis", "samples_per_s"),
                   "redis_packed_vs_files": paired(runs, "redis-packed", "samples_per_s"),
                   "directory_cpu_vs_files": paired(runs, "directory", "cpu_s_per_1000"),
                   "redis_cpu_vs_files": paired(runs, "redis", "cpu_s_per_1000"),
                   "redis_packed_cpu_vs_files": paired(runs, "redis-packed", "cpu_s_per_1000"),
                   "metrics_overhead": 1 - med["metrics"]["samples_per_s"] / med["files"]["samples_per_s"],
                   "metrics_cpu_overhead": med["metrics"]["cpu_s_per_1000"] / med["files"]["cpu_s_per_1000"] - 1,
                   "metrics_cost_share": statistics.median(x["metrics_cost_share"] for x in runs["metrics"]),
                   "live_packed": live(args, "live", server.url,
                                       RedisProducer(server.url, args.partitions, "livepacked", True), serialized,
                                       med["redis-packed"]["samples_per_s"]),
                   "live": live(args, "live", server.url, RedisProducer(server.url, args.partitions, "live", False),
                                serialized, med["redis"]["samples_per_s"]),
                   "live_directory": live(args, "live-directory", os.path.join(work, "live"),
                                          FileProducer(os.path.join(work, "live"), args.partitions), serialized,
                                          med["directory"]["samples_per_s"])}
            print(json.dumps(out), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
