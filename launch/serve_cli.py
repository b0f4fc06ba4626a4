"""shardrec-serve: a model server that speaks TF Serving's REST and gRPC APIs and follows a training job.

    shardrec-serve SAVED_MODEL [--follow MODEL_DIR] [--model-name NAME] [--port 8501] [--grpc-port 8500]
                   [--host 127.0.0.1] [--threads 8] [--max-body-mb 64] [--poll-s 0.5]
                   [--tensorflow-inter-op-parallelism 0] [--tensorflow-intra-op-parallelism 0]
                   [--enable-batching [--max-batch-size 1000] [--batch-timeout-micros 0]
                    [--num-batch-threads CPUS] [--max-enqueued-batches 10]]

SAVED_MODEL: what shardrec-export wrote (its graph and signatures are served). With --follow, the
rows and dense variables come from MODEL_DIR's newest complete checkpoint, and every later save of
the job is applied as it is listed (a delta in place, in well under a second; a full save loaded
beside and swapped in), each as a new version numbered by its step. Without --follow it serves the
SavedModel's own variables as version 0. Listens on 127.0.0.1 unless --host says otherwise; with
--grpc-port also speaks gRPC (PredictionService, ModelService, grpc.health.v1) there and prints
`grpc NAME on HOST:PORT`; prints `serving NAME on http://HOST:PORT` once both answer. With
--enable-batching, concurrent requests on a signature whose inputs and outputs are all batched run
together (TF Serving's batching knobs and defaults). Exit status 2 on bad arguments or a SavedModel
that cannot be loaded; SIGTERM or Ctrl-C stops it.
"""
import argparse
import os
import signal
import sys
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    from shardrec.rank_runtime.serving.live.batching import BatchOptions


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="shardrec-serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("saved_model", help="a SavedModel written by shardrec-export (or Estimator.export_saved_model)")
    p.add_argument("--follow", metavar="MODEL_DIR", help="a training job's model directory to take versions from")
    p.add_argument("--model-name", default="model", help="the NAME in /v1/models/NAME (default: model)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: this host only)")
    p.add_argument("--port", type=int, default=8501, help="0: any free port (printed)")
    p.add_argument("--grpc-port", type=int, default=None, help="also serve TF Serving's gRPC API on this port "
                   "(TF Serving's --port; 0: any free port, printed)")
    p.add_argument("--threads", type=int, default=8, help="requests in flight at once (each API)")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="a larger request body gets 413 (REST), a larger "
                   "message RESOURCE_EXHAUSTED (gRPC)")
    b = p.add_argument_group("batching (TF Serving's --enable_batching and batching parameters)")
    b.add_argument("--enable-batching", action="store_true", help="run concurrent requests together")
    b.add_argument("--max-batch-size", type=int, default=1000, help="instances in a batch at most (default 1000); "
                   "a larger request runs alone")
    b.add_argument("--batch-timeout-micros", type=int, default=0, help="how long the oldest request waits for a "
                   "batch to fill (default 0: a free batch thread takes what is queued)")
    b.add_argument("--num-batch-threads", type=int, default=os.cpu_count() or 1, help="batches run at once "
                   "(default: the CPUs)")
    b.add_argument("--max-enqueued-batches", type=int, default=10, help="batches' worth of requests that may "
                   "wait (default 10); more are refused (503 / UNAVAILABLE)")
    p.add_argument("--poll-s", type=float, default=0.5, help="seconds between looks at MODEL_DIR's state file")
    t = p.add_argument_group("the model's threads (TF Serving's --tensorflow_inter_op_parallelism and "
                             "--tensorflow_intra_op_parallelism)")
    t.add_argument("--tensorflow-inter-op-parallelism", type=int, default=0, metavar="N",
                   help="threads that run a request's independent ops (0, default: TensorFlow picks, the CPUs; "
                   "-1: each request's ops run in the thread that serves it)")
    t.add_argument("--tensorflow-intra-op-parallelism", type=int, default=0, metavar="N",
                   help="threads one op may split its work over (0, default: TensorFlow picks, the CPUs)")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.saved_model, "saved_model.pb")):
        p.error(f"{args.saved_model}: not a SavedModel (no saved_model.pb); write one with shardrec-export")
    if args.follow is not None and not os.path.isdir(args.follow):
        p.error(f"--follow {args.follow}: no such directory")
    if not (0 <= args.port < 65536) or args.threads < 1 or args.max_body_mb <= 0 or args.poll_s <= 0:
        p.error("--port must be 0..65535, --threads >= 1, --max-body-mb and --poll-s > 0")
    if args.grpc_port is not None and not 0 <= args.grpc_port < 65536:
        p.error(f"--grpc-port {args.grpc_port}: must be 0..65535")
    if args.max_batch_size < 1 or args.batch_timeout_micros < 0 or args.num_batch_threads < 1 \
            or args.max_enqueued_batches < 1:
        p.error("--max-batch-size, --num-batch-threads and --max-enqueued-batches must be >= 1, "
                "--batch-timeout-micros >= 0")
    if args.tensorflow_inter_op_parallelism < -1 or args.tensorflow_intra_op_parallelism < 0:
        p.error("--tensorflow-inter-op-parallelism must be -1 (the request's thread), 0 (TensorFlow picks) or a "
                "count of threads; --tensorflow-intra-op-parallelism 0 or a count")
    return args


def batch_options(args: argparse.Namespace) -> "Optional[BatchOptions]":
    from shardrec.rank_runtime.serving.live.batching import BatchOptions

    if not args.enable_batching:
        return None
    return BatchOptions(args.max_batch_size, args.batch_timeout_micros, args.num_batch_threads,
                        args.max_enqueued_batches)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import tensorflow as tf

    from shardrec.rank_runtime.serving.live.follower import Follower, Served
    from shardrec.rank_runtime.serving.live.http_app import AppSettings, RestApp, make_server
    from shardrec.rank_runtime.serving.live.model_graph import ModelGraph
    from shardrec.rank_runtime.serving.live.predictor import Predictor
    from shardrec.rank_runtime.serving.live.server_metrics import ServerMetrics
    from shardrec.rank_runtime.serving.live.versions import ServedVersion, VersionInfo

    try:
        graph = ModelGraph(args.saved_model, session_config=tf.compat.v1.ConfigProto(
            inter_op_parallelism_threads=args.tensorflow_inter_op_parallelism,
            intra_op_parallelism_threads=args.tensorflow_intra_op_parallelism))
    except (OSError, RuntimeError, ValueError, tf.errors.OpError) as e:
        print(f"shardrec-serve: {args.saved_model}: cannot load the SavedModel: {e}", file=sys.stderr)
        return 2
    served = Served(graph, ServerMetrics())
    follower = None
    if args.follow is not None:
        if not graph.follows_checkpoints:
            print(f"shardrec-serve: {args.saved_model} has no shardrec tables' layout (it was not written by "
                  "shardrec-export, or by one older than shardrec-serve), so it cannot follow checkpoints: export "
                  "it again with shardrec-export, or serve it without --follow", file=sys.stderr)
            return 2
        follower = Follower(served, args.follow, args.poll_s)
        if not follower.load_newest():
            print(f"shardrec-serve: no checkpoint of {args.follow} loads yet; serving starts with the first one",
                  file=sys.stderr)
        follower.start()
    else:
        session = graph.new_session()
        graph.load_own_variables(session)
        served.swap(ServedVersion(graph, session, VersionInfo(0, args.saved_model, None, 0.0, 0.0), {}))
    limit = int(args.max_body_mb * 2**20)
    predictor = Predictor(served, args.model_name, batch_options(args))
    grpc_server = None
    try:
        if args.grpc_port is not None:
            from shardrec.rank_runtime.serving.live.grpc_api import GrpcServer

            grpc_server = GrpcServer(predictor, args.host, args.grpc_port, args.threads, limit)
            grpc_server.start()
            print(f"grpc {args.model_name} on {args.host}:{grpc_server.port}", flush=True)
        server = make_server(RestApp(predictor, AppSettings(args.model_name, limit)), args.host, args.port,
                             args.threads)
    except OSError as e:
        print(f"shardrec-serve: cannot listen: {e}", file=sys.stderr)
        if grpc_server is not None:
            grpc_server.stop()
        return 2
    batched = [name for name, on in predictor.batched.items() if on]
    if args.enable_batching:
        print(f"batching signatures {batched} (the others run each request alone: an input or output without "
              "the batch as its first dimension)", flush=True)
    signal.signal(signal.SIGTERM, _stop)
    print(f"serving {args.model_name} on http://{args.host}:{server.effective_port}", flush=True)
    try:
        server.run()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        if follower is not None:
            follower.stop()
        if grpc_server is not None:
            grpc_server.stop()
        predictor.close()
        server.close()
    return 0


def _stop(signum, frame):
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
