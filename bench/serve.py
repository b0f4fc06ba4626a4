"""Live serving (shardrec-serve): what applying a delta costs against a full re-export, and requests over
TF Serving's REST and gRPC APIs, each with and without server-side batching, against a plain
tf.saved_model.load as the floor.

    python bench/serve.py [--keys 5000000] [--dim 16] [--deltas 16] [--rates 200] [--batch 256] [--load-s 30]
                          [--saturate-s 15]

1. Checkpoints (one rank, lazy Adam): a full save of --keys keys, then --deltas deltas, each after one
   step of the sparse step's workload (about 1% of the rows change), as bench/incremental.py does.
2. The SavedModel of the full save (shardrec-export's code), timed: the full re-export a numbered
   version directory costs at every interval; and a re-export of the last delta (its chain).
3. shardrec-serve (the real command, REST and --grpc-port) follows the model directory: listed one at a
   time, each delta's time from being listed (its commit: the Saver lists a save once every rank
   committed it) to the status endpoint reporting its version, polled every 5 ms; and the apply time
   the server logs.
4. For the server without batching, then with --enable-batching (TF Serving's defaults), and each API:
   an open-loop client sends --rates requests/s of --batch instances (26 ids each; REST: columnar JSON
   on keep-alive connections; gRPC: a PredictRequest of tensor_content, one channel), latency from each
   request's scheduled time (a stall counts for the requests it delays); --load-s without updates, then
   --load-s with a delta listed every --update-every s. The server's CPU per request (psutil, its
   process's user + system time over the load). Then saturation: 16 clients in a closed loop for
   --saturate-s, requests/s answered.
5. The floor: the same batches through tf.saved_model.load's function in a loop: latency and CPU per
   batch (a process of its own).
Prints one JSON line.
"""
import argparse
import http.client
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import psutil
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peers  # noqa: E402
import workload  # noqa: E402

FIELDS = 26


def model_fn(dim):
    def outputs(features):
        from shardrec.rank_runtime import create_table, sparse_lookup

        table = create_table(tf.int64, dim, "emb", tf.compat.v1.zeros_initializer())
        emb = sparse_lookup(table, features["ids"], modify_graph=True)
        return {"score": tf.sigmoid(tf.reduce_sum(emb, axis=[1, 2]))}
    return outputs


def write_checkpoints(args, root):
    """The full save (step 1) and the deltas (steps 2..); returns (their paths, changed rows each)."""
    from shardrec.rank_runtime import Saver, init
    from shardrec.rank_runtime.process import config

    init(is_incremental_checkpoint=True, save_checkpoint_due_time=2**31 - 1, save_delta_checkpoints_secs=1)
    keys, rows, _ = workload.make_batches(args.deltas + 1, 4096, FIELDS, 10_000_000)
    op, setup = peers.PEERS["shardrec"](workload.batch_dataset(keys, rows), args.dim, "lazy_adam",
                                        args.keys + int(keys.size) + 16)
    table = config.get_table("emb")
    saver = Saver(max_to_keep=0)
    paths, changed = [], []
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        step = setup(sess) or (lambda: sess.run(op))
        step()
        table.index.lookup(np.arange(max(0, args.keys - table.size()), dtype=np.int64) + 2**40, allocate=True)
        for at in range(1, args.deltas + 2):
            if at > 1:
                step()
                changed.append(table.index.changed_rows())
            paths.append(saver.save(sess, os.path.join(root, "model"), global_step=at, save_delta=at > 1,
                                    write_state=False))
            print(f"[bench] saved {paths[-1]}", file=sys.stderr, flush=True)
    return paths, changed, keys


def model_arguments(p, keys):
    """The table and the requests every serving benchmark takes."""
    p.add_argument("--keys", type=int, default=keys)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=256, help="instances a request")


def exported(args, root):
    """The checkpoints (write_checkpoints) and the SavedModel of the first, in `root`: (their paths, the
    ids the job read, the SavedModel's directory)."""
    from shardrec.rank_runtime import export_saved_model

    paths, _, keys = write_checkpoints(args, root)
    export = os.path.join(root, "export")
    export_saved_model(paths[0], export, model_fn(args.dim), {"ids": tf.TensorSpec([None, FIELDS], tf.int64)})
    return paths, keys, export


def _list(root, paths):
    from tensorflow.python.checkpoint import checkpoint_management

    checkpoint_management.update_checkpoint_state_internal(root, paths[-1], list(paths))


def _status_version(conn):
    conn.request("GET", "/v1/models/model")
    r = conn.getresponse()
    body = json.loads(r.read())
    return int(body["model_version_status"][0]["version"]) if "model_version_status" in body else None


def start_server(export, root, batching, extra=()):
    cli = os.path.join(os.path.dirname(sys.executable), "shardrec-serve")
    proc = subprocess.Popen([cli, export, "--follow", root, "--port", "0", "--grpc-port", "0", "--poll-s", "0.1",
                             "--threads", "16"] + (["--enable-batching"] if batching else []) + list(extra),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    lines, target = [], None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("grpc "):
            target = line.split(" on ", 1)[1].strip()
        if line.startswith("serving "):
            break
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    host, port = line.split("//", 1)[1].strip().split(":")
    return proc, host, int(port), target, lines


def wait_version(host, port, version, timeout=120):
    """Seconds until the server reports `version` (polled every 5 ms)."""
    conn, start = http.client.HTTPConnection(host, port, timeout=10), time.perf_counter()
    while time.perf_counter() - start < timeout:
        if _status_version(conn) == version:
            return time.perf_counter() - start
        time.sleep(0.005)
    raise RuntimeError(f"version {version} not served in {timeout} s")


def batches(keys, args, count=16):
    rng = np.random.default_rng(1)
    flat = keys.reshape(-1)
    return [rng.choice(flat, (args.batch, FIELDS)).astype(np.int64) for _ in range(count)]


def bodies(arrays):
    return [json.dumps({"inputs": {"ids": a.tolist()}}).encode() for a in arrays]


def grpc_requests(arrays):
    from tensorflow_serving.apis import predict_pb2

    out = []
    for a in arrays:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "model"
        request.inputs["ids"].CopyFrom(tf.make_tensor_proto(a))
        out.append(request)
    return out


class Api:
    """One way to send a predict request: send(connection, payload) -> ok."""

    def __init__(self, name, host, port, target, payloads):
        self.name, self.host, self.port, self.target, self.payloads = name, host, port, target, payloads

    def connect(self):
        if self.name == "rest":
            return http.client.HTTPConnection(self.host, self.port, timeout=60)
        import grpc
        from tensorflow_serving.apis import prediction_service_pb2_grpc

        return prediction_service_pb2_grpc.PredictionServiceStub(grpc.insecure_channel(self.target))

    def send(self, conn, payload) -> bool:
        if self.name == "rest":
            conn.request("POST", "/v1/models/model:predict", payload, {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            return r.status == 200
        import grpc

        try:
            conn.Predict(payload, timeout=60)
            return True
        except grpc.RpcError:
            return False


def _cpu(proc) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def load(api, server, rate, seconds, workers=16):
    """Open loop: requests scheduled every 1/rate s; latency from the scheduled time."""
    todo, latencies, errors = queue.Queue(), [], [0]
    payloads = api.payloads

    def worker():
        conn = api.connect()
        while True:
            item = todo.get()
            if item is None:
                return
            at, body = item
            if not api.send(conn, body):
                errors[0] += 1
            latencies.append(time.perf_counter() - at)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
    for t in threads:
        t.start()
    cpu = _cpu(server)
    start = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        at = start + i / rate
        time.sleep(max(0.0, at - time.perf_counter()))
        todo.put((at, payloads[i % len(payloads)]))
    for _ in threads:
        todo.put(None)
    for t in threads:
        t.join()
    ms = np.array(latencies) * 1000
    return {"requests": n, "errors": errors[0], "achieved_per_s": n / (time.perf_counter() - start),
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "server_cpu_ms_per_request": (_cpu(server) - cpu) * 1000 / n}


def saturate(api, server, seconds, workers=16):
    """Closed loop: `workers` clients each send the next request once answered; requests/s answered."""
    stop, done, errors = threading.Event(), [0] * workers, [0]

    def worker(i):
        conn = api.connect()
        while not stop.is_set():
            if api.send(conn, api.payloads[done[i] % len(api.payloads)]):
                done[i] += 1
            else:
                errors[0] += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(workers)]
    cpu, start = _cpu(server), time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed, n = time.perf_counter() - start, sum(done)
    return {"answered_per_s": n / elapsed, "errors": errors[0],
            "server_cpu_ms_per_request": (_cpu(server) - cpu) * 1000 / max(1, n)}


def floor(export, arrays):
    """The same batches through a plain tf.saved_model.load's function, one after another (run in a
    process of its own: eager execution on): latency and CPU per batch."""
    fn = tf.saved_model.load(export).signatures["serving_default"]
    batches = [tf.constant(a) for a in arrays]
    for b in batches:
        fn(ids=b)
    ms = []
    cpu = time.process_time()
    for i in range(400):
        start = time.perf_counter()
        fn(ids=batches[i % len(batches)])["score"].numpy()
        ms.append((time.perf_counter() - start) * 1000)
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "cpu_ms_per_batch": (time.process_time() - cpu) * 1000 / 400}


def _applied(lines):
    return [float(m.group(1)) for m in re.finditer(r"a delta applied in place in ([\d.]+) s", "".join(lines))]


def _bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run(args):
    from shardrec.rank_runtime import export_saved_model

    root = tempfile.mkdtemp(prefix="shardrec-bench-serve-", dir=args.dir)
    out = {"keys": args.keys, "dim": args.dim}
    try:
        paths, changed, keys = write_checkpoints(args, root)
        out["changed_rows"] = changed
        inputs = {"ids": tf.TensorSpec([None, FIELDS], tf.int64)}
        start = time.perf_counter()
        export_saved_model(paths[0], os.path.join(root, "export"), model_fn(args.dim), inputs)
        out["full_export_s"] = time.perf_counter() - start
        out["full_export_bytes"] = _bytes(os.path.join(root, "export"))
        start = time.perf_counter()
        export_saved_model(paths[-1], os.path.join(root, "export-last"), model_fn(args.dim), inputs)
        out["reexport_of_a_delta_s"] = time.perf_counter() - start
        out["delta_bytes"] = [_bytes(os.path.join(root, f"sparse-model-{i}")) for i in range(2, args.deltas + 2)]
        shutil.rmtree(os.path.join(root, "export-last"))
        _list(root, paths[:1])
        arrays = batches(keys, args)
        payloads = {"rest": bodies(arrays), "grpc": grpc_requests(arrays)}
        listed_to_served = []
        configs = [(api, batching) for batching in (False, True) for api in ("rest", "grpc")]
        during = len(configs) * len(args.rates) * int(args.load_s // args.update_every)
        half = max(1, args.deltas - during)  # the rest arrive during the loads with updates
        listed = 1
        for batching in (False, True):
            started = time.perf_counter()
            proc, host, port, target, lines = start_server(os.path.join(root, "export"), root, batching)
            server = psutil.Process(proc.pid)
            out.setdefault("server_start_with_full_load_s", []).append(time.perf_counter() - started)
            if not batching:
                for i in range(1, 1 + half):
                    _list(root, paths[:i + 1])
                    listed_to_served.append(wait_version(host, port, i + 1))
                listed = 1 + half
            for api_name in ("rest", "grpc"):
                api = Api(api_name, host, port, target, payloads[api_name])
                tag = f"{api_name}{'_batching' if batching else ''}"
                for rate in args.rates:
                    out[f"{tag}_without_updates_{rate:g}"] = load(api, server, rate, args.load_s)
                    stop, updates = threading.Event(), []

                    def updater():
                        nonlocal listed
                        while listed < len(paths) and not stop.wait(args.update_every):
                            listed += 1
                            _list(root, paths[:listed])
                            updates.append(wait_version(host, port, listed))

                    t = threading.Thread(target=updater, daemon=True)
                    t.start()
                    out[f"{tag}_with_updates_{rate:g}"] = load(api, server, rate, args.load_s)
                    stop.set()
                    t.join()
                    out[f"{tag}_updates_during_load_{rate:g}"] = len(updates)
                    out[f"{tag}_p99_with_over_without_{rate:g}"] = (out[f"{tag}_with_updates_{rate:g}"]["p99_ms"]
                                                                    / out[f"{tag}_without_updates_{rate:g}"]["p99_ms"])
                    listed_to_served += updates
                out[f"{tag}_saturation"] = saturate(api, server, args.saturate_s)
            out.setdefault("server_apply_s", []).extend(_applied(lines))
            proc.terminate()
            proc.wait(timeout=30)
        out["listed_to_served_s"] = listed_to_served
        np.save(os.path.join(root, "batches.npy"), np.stack(arrays))
        floor_out = subprocess.run([sys.executable, __file__, "--floor", os.path.join(root, "export"),
                                    "--floor-batches", os.path.join(root, "batches.npy")],
                                   capture_output=True, text=True, check=True)
        out["floor_saved_model_load"] = json.loads(floor_out.stdout.strip().splitlines()[-1])
        for rate in args.rates:
            out[f"grpc_p50_over_rest_p50_{rate:g}"] = (out[f"grpc_without_updates_{rate:g}"]["p50_ms"]
                                                       / out[f"rest_without_updates_{rate:g}"]["p50_ms"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main():
    p = argparse.ArgumentParser()
    model_arguments(p, 5_000_000)
    p.add_argument("--deltas", type=int, default=16, help="those not needed during the loads are listed before")
    p.add_argument("--rates", type=float, nargs="+", default=[200.0], help="requests per second")
    p.add_argument("--load-s", type=float, default=30.0)
    p.add_argument("--saturate-s", type=float, default=15.0)
    p.add_argument("--update-every", type=float, default=10.0)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: the temporary directory)")
    p.add_argument("--floor", metavar="EXPORT", help=argparse.SUPPRESS)
    p.add_argument("--floor-batches", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.floor:
        print(json.dumps(floor(args.floor, list(np.load(args.floor_batches)))))
        return
    tf.compat.v1.disable_eager_execution()
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
