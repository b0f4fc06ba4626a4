"""Freshness end to end: from an event entering the stream to its key's row being served.

    python bench/serve_freshness.py [--seconds 90] [--rate 1000] [--delta-s 10]

A Redis server, a producer of the stream demo's Wide&Deep events (--rate a second, packed entries
every 0.5 s), each chunk with one event whose id (field 0) was never sent before; the demo's
training job on 2 ranks under shardrec-run, a delta every --delta-s (the guide's
save_delta_checkpoints_secs); shardrec-serve following its model directory, serving a SavedModel
whose outputs include the deep table's rows. A prober asks every 0.2 s for the rows of the new ids
not yet served: an id's freshness is the time from its event's XADD to the first response in which
its row is there (a row served is the checkpoint's, bit for bit: tests/test_live_serving.py).
Prints one JSON line: p50, p99 and max over the ids sent once the server was up.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)
import criteo_synth  # noqa: E402

FIRST_NEW = 4_100_000_000  # in field 0's key range, above every id criteo_synth draws (< 2**32)


def rows_model(features):
    """wide_deep's serving model, with the deep rows as an output."""
    import tensorflow as tf

    import wide_deep
    from shardrec.rank_runtime import create_table, sparse_lookup

    tables = [create_table(key_dtype=tf.int64, dim=wide_deep.DEEP_DIM, name="deep_table",
                           emb_initializer=tf.compat.v1.zeros_initializer()),
              create_table(key_dtype=tf.int64, dim=1, name="wide_table", emb_initializer=tf.compat.v1.zeros_initializer())]
    deep_spec, wide_spec = wide_deep.feature_specs()
    deep = sparse_lookup(tables[0], deep_spec, batch=features, is_train=False)
    wide = sparse_lookup(tables[1], wide_spec, batch=features, is_train=False)
    return {"prob": tf.sigmoid(wide_deep.DenseTower()(deep, wide, features["dense"])), "deep": deep}


class Producer(threading.Thread):
    def __init__(self, url, rate, partitions=4, seed=2024):
        super().__init__(daemon=True)
        import redis

        self.client, self.rate, self.partitions, self.seed = redis.Redis.from_url(url), rate, partitions, seed
        self.sent = {}  # new id -> time of its XADD
        self.done = threading.Event()

    def run(self):
        import stream_wide_deep
        from shardrec.rank_runtime import pack_records

        args = argparse.Namespace(seed=self.seed)
        per_chunk = max(self.partitions, int(self.rate / 2) // self.partitions * self.partitions)
        start, number = time.time(), 0
        while not self.done.is_set():
            data, ts = stream_wide_deep.events(args, np.arange(number * per_chunk, (number + 1) * per_chunk), 0)
            new = FIRST_NEW + number
            data["cat"][0, 0] = new
            records = stream_wide_deep.serialize(data, ts)
            for p in range(self.partitions):
                self.client.xadd(f"events:{p}", {"records": pack_records(records[p::self.partitions])})
                if p == 0:
                    self.sent[new] = time.time()
            number += 1
            time.sleep(max(0.0, start + number * per_chunk / self.rate - time.time()))


def probe(url, producer, since, stop, served):
    """Asks for the rows of the new ids sent after `since` and not yet served."""
    base = criteo_synth.make_dataset(1, seed=2024, sample_seed=[2024, 7])
    while not stop.wait(0.2):
        pending = [k for k, t in list(producer.sent.items()) if t >= since and k not in served]
        if not pending:
            continue
        cat = np.repeat(base["cat"], len(pending), axis=0)
        cat[:, 0] = pending
        body = json.dumps({"inputs": {"cat": cat.tolist(), "dense": np.repeat(base["dense"], len(pending), 0).tolist()}})
        request = urllib.request.Request(f"{url}/v1/models/model:predict", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            deep = np.asarray(json.load(r)["outputs"]["deep"], np.float32)
        now = time.time()
        for key, rows in zip(pending, deep):
            if rows[0].any():
                served[key] = now - producer.sent[key]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=90.0, help="measured once the server is up")
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--delta-s", type=int, default=10)
    args = p.parse_args()
    from shardrec.launch.redis_server import RedisServer

    work = tempfile.mkdtemp(prefix="shardrec-bench-fresh-")
    model, bin_dir = os.path.join(work, "model"), os.path.dirname(sys.executable)
    redis_server = RedisServer(os.path.join(work, "redis")).start()
    producer = Producer(redis_server.url, args.rate)
    producer.start()
    trainer = subprocess.Popen([os.path.join(bin_dir, "shardrec-run"), "-np", "2", "--checkpoint-dir", model,
                                "--run-dir", os.path.join(work, "run"), "--", sys.executable,
                                os.path.join(EXAMPLES, "stream_wide_deep.py"), "train", "--broker", redis_server.url,
                                "--name", "events", "--partitions", "4", "--model-dir", model, "--idle", "0",
                                "--incremental", f"100000,{args.delta_s}", "--evict-after", "100000"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = None
    try:
        import serve_while_training

        checkpoint = serve_while_training._wait_for_checkpoint(model, trainer)
        subprocess.run([os.path.join(bin_dir, "shardrec-export"), checkpoint, "--out", os.path.join(work, "export"),
                        "--model-fn", f"{os.path.abspath(__file__)}:rows_model", "--feature", "cat=int64[-1,26]",
                        "--feature", "dense=float32[-1,13]"], check=True, stdout=subprocess.DEVNULL)
        server = subprocess.Popen([os.path.join(bin_dir, "shardrec-serve"), os.path.join(work, "export"), "--follow",
                                   model, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        url = server.stdout.readline().strip().rsplit(" ", 1)[-1]
        since, stop, served = time.time(), threading.Event(), {}
        prober = threading.Thread(target=probe, args=(url, producer, since, stop, served), daemon=True)
        prober.start()
        time.sleep(args.seconds)
        producer.done.set()
        time.sleep(args.delta_s * 2 + 5)  # the last ids' delta
        stop.set()
        prober.join()
    finally:
        producer.done.set()
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(timeout=120)
        if server is not None:
            server.terminate()
        redis_server.stop()
        shutil.rmtree(work, ignore_errors=True)
    sent = [k for k, t in producer.sent.items() if t >= since]
    latencies = np.array([served[k] for k in sent if k in served])
    print(json.dumps({"delta_s": args.delta_s, "ids_sent": len(sent), "ids_served": len(latencies),
                      "p50_s": float(np.percentile(latencies, 50)), "p99_s": float(np.percentile(latencies, 99)),
                      "max_s": float(latencies.max())}), flush=True)


if __name__ == "__main__":
    main()
