"""Where shardrec-serve runs a request's ops: in the thread that serves the request
(`--tensorflow-inter-op-parallelism -1`) or on TensorFlow's inter-op pool (0, the default: TensorFlow's
own), each setting its own server on the same export, requests alternating between them.

    python bench/serve_threads.py [--keys 1000000] [--settings -1 0] [--rate 200] [--load-s 10] [--rounds 3]

Per round, per setting, per API (REST columnar JSON, gRPC PredictRequest; bench/serve.py's clients):
--sequential requests one at a time (latency p50, the server's CPU a request), then an open-loop load of
--rate requests/s for --load-s (p50, p99, the server's CPU a request). Prints one JSON line: every round's
figures and their medians.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import psutil
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import serve  # noqa: E402


def sequential(api, server, count):
    conn, ms = api.connect(), []
    cpu = serve._cpu(server)
    for i in range(count):
        start = time.perf_counter()
        if not api.send(conn, api.payloads[i % len(api.payloads)]):
            raise RuntimeError(f"{api.name} request {i} failed")
        ms.append((time.perf_counter() - start) * 1000)
    return {"p50_ms": float(np.percentile(ms, 50)), "server_cpu_ms_per_request": (serve._cpu(server) - cpu) * 1000
            / count}


def main():
    p = argparse.ArgumentParser()
    serve.model_arguments(p, 1_000_000)
    p.add_argument("--settings", type=int, nargs="+", default=[-1, 0])
    p.add_argument("--rate", type=float, default=200.0)
    p.add_argument("--load-s", type=float, default=10.0)
    p.add_argument("--sequential", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    args.deltas = 0
    tf.compat.v1.disable_eager_execution()
    root = tempfile.mkdtemp(prefix="shardrec-bench-serve-threads-")
    servers = []  # (setting, process, {api name: Api})
    try:
        paths, keys, export = serve.exported(args, root)
        serve._list(root, paths)
        arrays = serve.batches(keys, args)
        payloads = {"rest": serve.bodies(arrays), "grpc": serve.grpc_requests(arrays)}
        for setting in args.settings:
            proc, host, port, target, _ = serve.start_server(
                export, root, False, ["--tensorflow-inter-op-parallelism", str(setting)])
            apis = {name: serve.Api(name, host, port, target, payloads[name]) for name in payloads}
            servers.append((setting, proc, apis))
            for api in apis.values():
                sequential(api, psutil.Process(proc.pid), 20)  # connections and the first runs
        rounds = []
        for r in range(args.rounds):
            for setting, proc, apis in servers:
                server = psutil.Process(proc.pid)
                for name, api in apis.items():
                    figures = {"round": r, "setting": setting, "api": name,
                               "sequential": sequential(api, server, args.sequential),
                               "load": serve.load(api, server, args.rate, args.load_s)}
                    rounds.append(figures)
                    print(f"[bench] {json.dumps(figures)}", file=sys.stderr, flush=True)
        medians = {}
        for setting in args.settings:
            for name in payloads:
                mine = [f for f in rounds if f["setting"] == setting and f["api"] == name]
                medians[f"{setting}_{name}"] = {
                    "sequential_p50_ms": float(np.median([f["sequential"]["p50_ms"] for f in mine])),
                    "sequential_cpu_ms": float(np.median([f["sequential"]["server_cpu_ms_per_request"] for f in mine])),
                    "load_p50_ms": float(np.median([f["load"]["p50_ms"] for f in mine])),
                    "load_p99_ms": float(np.median([f["load"]["p99_ms"] for f in mine])),
                    "load_cpu_ms": float(np.median([f["load"]["server_cpu_ms_per_request"] for f in mine]))}
        print(json.dumps({"keys": args.keys, "rate": args.rate, "rounds": rounds, "medians": medians}), flush=True)
    finally:
        for _, proc, _ in servers:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
