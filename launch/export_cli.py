"""shardrec-export: a trained model as a SavedModel that stock TensorFlow serves.

    shardrec-export CHECKPOINT_OR_MODEL_DIR [PREFIX ...] --out DIR --model-fn FILE.py:NAME (or module:NAME)
                    --feature NAME=DTYPE[SHAPE] [--feature ...] [--params JSON] [--overwrite]
                    [--versions [--every SECONDS] [--keep K]]

The inference graph is rebuilt from the user's script: NAME is either an Estimator model_fn
(features, labels, mode, params), called with mode PREDICT and exported with its predictions, or a
function features -> {output name: tensor} (tf.Session mode). Each --feature declares one input of
the signature, e.g. `--feature cat=int64[-1,26] --feature dense=float32[-1,13]` (-1: any size).
Runs on one process without MPI; reads every rank's shard of the newest (or the given) checkpoint; a
checkpoint saved under a path per rank (seed 001's `model-{rank}`) is given as every rank's prefix.
--versions: --out is a base of numbered version directories for TF Serving or Triton: the model
directory's newest checkpoint is written as OUT/<its step> (beside, then moved into place) when it is
newer than every version there, and versions beyond the newest --keep (default 5) are removed;
--every SECONDS does that again every SECONDS until SIGTERM or Ctrl-C.
Exit status: 0 written, 1 when the checkpoint is damaged or the model cannot be built, 2 on bad
arguments (an --out that exists without --overwrite included).
"""
import argparse
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
from typing import Callable, List, Optional

_FEATURE = re.compile(r"([A-Za-z_][\w./-]*)=(\w+)\[([-\d, ]*)\]")


def _feature(text):
    import tensorflow as tf

    m = _FEATURE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=DTYPE[SHAPE], e.g. cat=int64[-1,26]")
    try:
        dtype = tf.as_dtype(m.group(2))
    except TypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: unknown dtype {m.group(2)!r} (int64, int32, float32, ...)")
    shape = [None if int(d) < 0 else int(d) for d in m.group(3).split(",") if d.strip()]
    return m.group(1), tf.TensorSpec(shape, dtype, name=m.group(1))


def _load_function(spec):
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--model-fn {spec!r}: expected FILE.py:NAME or module:NAME")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise FileNotFoundError(f"--model-fn: {where}: no such file")
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
        loader = importlib.util.spec_from_file_location("shardrec_export_model", where)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--model-fn {spec!r}: {where} has no function {name!r}")
    return fn


def as_outputs_fn(fn: Callable, params: Optional[dict]) -> Callable[[dict], dict]:
    """features -> outputs from either an Estimator model_fn (its PREDICT spec's predictions) or a
    Session-mode function."""
    import tensorflow as tf

    args = set(inspect.signature(fn).parameters)
    if "mode" not in args:
        return fn

    def outputs(features):
        kwargs = {"features": features, "labels": None, "mode": tf.estimator.ModeKeys.PREDICT, "params": params,
                  "config": None}
        spec = fn(**{k: v for k, v in kwargs.items() if k in args})
        predictions = spec.predictions
        return predictions if isinstance(predictions, dict) else {"output": predictions}

    return outputs


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="shardrec-export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="+", help="a model directory (its newest checkpoint), a checkpoint prefix, or "
                   "every rank's prefix of a checkpoint saved under a path per rank")
    p.add_argument("--out", required=True, help="the SavedModel directory to write")
    p.add_argument("--model-fn", required=True, help="FILE.py:NAME or module:NAME")
    p.add_argument("--feature", action="append", type=_feature, required=True, metavar="NAME=DTYPE[SHAPE]")
    p.add_argument("--params", default="{}", help="JSON object passed as an Estimator model_fn's params")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--row-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="how the export holds the tables' rows (lookups return float32 either way)")
    p.add_argument("--versions", action="store_true", help="--out holds numbered versions (OUT/<step>)")
    p.add_argument("--every", type=float, help="with --versions: seconds between looks for a newer checkpoint")
    p.add_argument("--keep", type=int, default=5, help="with --versions: the versions kept (default 5)")
    args = p.parse_args(argv)
    if (args.every is not None or args.keep != 5) and not args.versions or args.keep < 1 or \
            args.every is not None and args.every <= 0:
        print("shardrec-export: --every (> 0) and --keep (>= 1) go with --versions", file=sys.stderr)
        return 2
    if os.path.exists(args.out) and not args.overwrite and not args.versions:
        print(f"shardrec-export: {args.out} exists; choose a new directory or pass --overwrite", file=sys.stderr)
        return 2
    try:
        params = json.loads(args.params)
    except json.JSONDecodeError as e:
        print(f"shardrec-export: --params is not JSON ({e})", file=sys.stderr)
        return 2
    import tensorflow as tf

    from shardrec.rank_runtime.serving.export import export_saved_model
    from shardrec.rank_runtime.formats.sparse_checkpoint import CheckpointError

    tf.compat.v1.disable_eager_execution()
    try:
        fn = as_outputs_fn(_load_function(args.model_fn), params)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"shardrec-export: {e}", file=sys.stderr)
        return 2
    errors = (CheckpointError, ValueError, KeyError, TypeError, FileExistsError, tf.errors.OpError)
    if args.versions:
        return _versions(args, fn, errors)
    try:
        checkpoint = args.checkpoint[0] if len(args.checkpoint) == 1 else args.checkpoint
        summary = export_saved_model(checkpoint, args.out, fn, dict(args.feature), overwrite=args.overwrite,
                                     row_dtype=args.row_dtype)
    except errors as e:
        print(f"shardrec-export: {e}", file=sys.stderr)
        return 1
    print("\n".join(summary.lines()))
    return 0


def _versions(args, fn, errors):
    import signal
    import time

    from shardrec.rank_runtime.serving.export import export_saved_model
    from shardrec.rank_runtime.serving.version_dirs import export_new_version

    def export(checkpoint, directory):
        print("\n".join(export_saved_model(checkpoint, directory, fn, dict(args.feature),
                                           row_dtype=args.row_dtype).lines()), flush=True)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        try:
            export_new_version(args.checkpoint[0], args.out, export, args.keep)
        except errors as e:
            print(f"shardrec-export: {e}", file=sys.stderr)
            if args.every is None:
                return 1
        if args.every is None:
            return 0
        time.sleep(args.every)


if __name__ == "__main__":
    sys.exit(main())
