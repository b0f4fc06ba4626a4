"""The Criteo-shaped DLRM's input alone, Parquet against TFRecord, in CPU time per sample: the
part of examples/dlrm.py's step that the file format decides (issue 56).

    python examples/dlrm.py write --out DIR --train-samples 131072
    python bench/dlrm_feeds.py --data DIR [--rounds 3] [--epochs 4] [--core 1]

Each round runs, for each format in turn, a fresh process pinned to one core that reads the
training split `--epochs` times through examples/dlrm.py's own input (`batches()`: ParquetDataset,
or TFRecordDataset + parse_example), batches of 2048, every output reduced so that all of it is
made, and nothing else. Prints the median CPU microseconds per sample of each format, the ratio,
and, with --step-us (the whole step's CPU per sample from bench/dlrm_peers.py, same machine), the
most that any feed could save of the step: (step) / (step - TFRecord's feed + Parquet's feed).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATS = ("parquet", "tfrecord")


def read(args):
    """One process: the feed alone; prints a JSON line of its CPU per sample."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import dlrm
    import tensorflow as tf

    from shardrec.rank_runtime import init

    tf.compat.v1.disable_eager_execution()
    init()
    dataset = dlrm.batches(args, "train", args.batch_size, False, 0, 1).repeat(args.epochs)
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    made = tf.group([tf.reduce_sum(tf.cast(t, tf.float32)) for t in tf.nest.flatten(batch)])
    samples = 0
    with tf.compat.v1.Session() as sess:
        sess.run(made)  # start-up outside the clock
        samples += args.batch_size
        start = time.process_time()
        while True:
            try:
                sess.run(made)
            except tf.errors.OutOfRangeError:
                break
            samples += args.batch_size
        cpu = time.process_time() - start
    print(json.dumps({"format": args.format, "samples": samples,
                      "cpu_us_per_sample": cpu * 1e6 / (samples - args.batch_size)}))


def compare(args):
    got, samples = {f: [] for f in FORMATS}, {}
    for r in range(args.rounds):
        for fmt in FORMATS:
            proc = subprocess.run(["taskset", "-c", str(args.core), sys.executable, __file__, "read", "--data",
                                   args.data, "--format", fmt, "--epochs", str(args.epochs), "--batch-size",
                                   str(args.batch_size)], capture_output=True, text=True, cwd=ROOT,
                                  env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
            line = next((x for x in proc.stdout.splitlines() if x.startswith("{")), None)
            if proc.returncode != 0 or line is None:
                raise SystemExit(f"{fmt} failed:\n{proc.stderr[-3000:]}")
            out = json.loads(line)
            got[fmt].append(out["cpu_us_per_sample"])
            samples[fmt] = out["samples"]
            print(f"round {r + 1} {fmt}: {got[fmt][-1]:.2f} us per sample", file=sys.stderr, flush=True)
    if samples["parquet"] != samples["tfrecord"]:
        raise SystemExit(f"the feeds read different sample counts: {samples}")
    med = {f: statistics.median(v) for f, v in got.items()}
    print(f"feed alone, CPU us per sample, median (min-max) of {args.rounds} round(s), one core:")
    for f in FORMATS:
        print(f"  {f:<9} {med[f]:.2f} ({min(got[f]):.2f}-{max(got[f]):.2f})")
    print(f"  TFRecord / Parquet: {med['tfrecord'] / med['parquet']:.1f}x")
    report = {"rounds": got, "median": med, "samples": samples["parquet"]}
    if args.step_us:
        best = args.step_us / (args.step_us - med["tfrecord"] + med["parquet"])
        print(f"  a step of {args.step_us} us per sample through TFRecord: Parquet makes it at most {best:.2f}x cheaper")
        report["step_ratio_bound"] = best
    print(json.dumps(report))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="compare", choices=["compare", "read"])
    p.add_argument("--data", required=True, help="what examples/dlrm.py write --out wrote")
    p.add_argument("--format", choices=FORMATS, help="read: the feed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--core", type=int, default=1)
    p.add_argument("--step-us", type=float, default=0.0,
                   help="the DLRM step's CPU us per sample through TFRecord (bench/dlrm_peers.py)")
    args = p.parse_args(argv)
    read(args) if args.mode == "read" else compare(args)


if __name__ == "__main__":
    main()
