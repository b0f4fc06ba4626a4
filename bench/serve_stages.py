"""What each stage of a predict request costs in shardrec-serve, over REST and over gRPC: CPU time per
request (time.process_time, one thread, no server around it), every stage run in turn on the same
batches, --rounds rounds alternating, the median printed.

    python bench/serve_stages.py [--keys 1000000] [--dim 16] [--batch 256] [--rounds 5] [--reps 200]

REST: the JSON body (256 x 26 ids, columnar) read by Python's json then numpy.array (what the server
did before) and by the native reader (what it does now), the checks against the signature, the
`session.run` of the served version, the response encoded (tolist, json.dumps). gRPC: the
PredictRequest parsed, its TensorProto to numpy (tf.make_ndarray), the same checks and run, the
response's TensorProtos built and serialized. The floor: the same batches through
tf.saved_model.load's function (a process of its own, eager), CPU per batch. Prints one JSON line.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import serve  # noqa: E402


def cpu_ms(fn, reps):
    fn()
    start = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - start) * 1000 / reps


def stages(export, save, arrays, reps, rounds):
    from tensorflow_serving.apis import predict_pb2

    from shardrec.native import json_arrays
    from shardrec.rank_runtime.serving.live.follower import Served
    from shardrec.rank_runtime.serving.live.grpc_api import _Calls
    from shardrec.rank_runtime.serving.live.model_graph import ModelGraph
    from shardrec.rank_runtime.serving.live.predictor import Predictor
    from shardrec.rank_runtime.serving.live.rest_api import encode_predict, parse_predict
    from shardrec.rank_runtime.serving.live.server_metrics import ServerMetrics
    from shardrec.rank_runtime.serving.live.versions import load_version

    graph = ModelGraph(export)
    served = Served(graph, ServerMetrics())
    served.swap(load_version(graph, save))
    predictor = Predictor(served, "model")
    calls = _Calls(predictor, 64 << 20)
    signature = predictor.signature("serving_default")
    bodies = serve.bodies(arrays)
    requests = [r.SerializeToString() for r in serve.grpc_requests(arrays)]
    feeds = {"ids": arrays[0]}
    outputs, _ = predictor.predict(signature, feeds, "model", None)
    parsed = predict_pb2.PredictRequest.FromString(requests[0])
    i = [0]

    def nxt(items):
        i[0] += 1
        return items[i[0] % len(items)]

    work = {
        "rest_json_python_and_numpy": lambda: np.array(json.loads(nxt(bodies))["inputs"]["ids"]),
        "rest_json_native": lambda: json_arrays.parse(nxt(bodies)),
        "rest_parse_and_check (native reader)": lambda: parse_predict(nxt(bodies), graph.signatures),
        "session_run": lambda: predictor.predict(signature, {"ids": nxt(arrays)}, "model", None),
        "rest_encode_response": lambda: json.dumps(encode_predict(outputs, False)).encode(),
        "grpc_parse_request": lambda: predict_pb2.PredictRequest.FromString(nxt(requests)),
        "grpc_tensor_to_numpy": lambda: tf.make_ndarray(parsed.inputs["ids"]),
        "grpc_whole_call (parse, check, run, encode)": lambda: calls.predict(
            predict_pb2.PredictRequest.FromString(nxt(requests))).SerializeToString(),
    }
    runs = {name: [] for name in work}
    for _ in range(rounds):
        for name, fn in work.items():
            runs[name].append(cpu_ms(fn, reps))
    return {name: {"median_ms": float(np.median(v)), "min_ms": float(min(v)), "max_ms": float(max(v))}
            for name, v in runs.items()}


def main():
    p = argparse.ArgumentParser()
    serve.model_arguments(p, 1_000_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    args.deltas = 1
    args.dir = None
    tf.compat.v1.disable_eager_execution()
    root = tempfile.mkdtemp(prefix="shardrec-bench-stages-")
    try:
        paths, keys, export = serve.exported(args, root)
        arrays = serve.batches(keys, args)
        out = {"keys": args.keys, "dim": args.dim, "batch": args.batch,
               "stages": stages(export, paths[0], arrays, args.reps, args.rounds)}
        np.save(os.path.join(root, "batches.npy"), np.stack(arrays))
        floor = subprocess.run([sys.executable, os.path.join(HERE, "serve.py"), "--floor", export,
                                "--floor-batches", os.path.join(root, "batches.npy")],
                               capture_output=True, text=True, check=True)
        out["floor_saved_model_load"] = json.loads(floor.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
