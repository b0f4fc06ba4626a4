"""What getting ids into the step costs, by feed, in CPU time per id, alternating in one run.

    python bench/feeds.py [--rounds 3] [--optimizer lazy_adam] [--dim 16] [--core 1]

On the single-core loop's keys (bench/limit.py: 50 batches of 4096 x 26), pinned to one core, each
round runs bench/sparse_step.py for every feed in turn: records (TFRecord tf.train.Examples parsed
by tf.data), parquet (the same samples as Parquet, ParquetDataset) and step-only (batches from
numpy), each once as the feed alone (peer feed_ids: the batch read and summed, no step) and once
under shardrec's sparse step. Prints per feed the median and spread of the feed's CPU per id (less
the step-only feed's, which reads nothing), the step's CPU per id and ids/s, and the step's rate
against the step-only rate; then one JSON line.
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from limit import WINDOWS, build, spread  # noqa: E402
from scaling import run as json_line  # noqa: E402

FEEDS = ("records", "parquet", "step-only")


def one(peer, feed, keys, core, optimizer, dim):
    warmup, steps, windows = WINDOWS["steady"]
    out = json_line(["taskset", "-c", str(core), sys.executable, "bench/sparse_step.py", "--peer", peer, "--feed", feed,
                     "--keys-file", keys, "--optimizer", optimizer, "--dim", str(dim), "--warmup", str(warmup),
                     "--steps", str(steps), "--windows", str(windows)])
    return out["cpu_ns_per_id"][0], out["ids_per_s"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--optimizer", default="lazy_adam", choices=["lazy_adam", "sgd"])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--core", type=int, default=1)
    p.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "shardrec-limit"))
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    _, keys = build(args.work)
    rounds = []
    for r in range(args.rounds):
        got = {}
        for feed in FEEDS:
            got[f"feed {feed}"] = one("feed_ids", feed, keys, args.core, args.optimizer, args.dim)
            got[f"step {feed}"] = one("shardrec", feed, keys, args.core, args.optimizer, args.dim)
        rounds.append(got)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[0]:.1f} ns/id" for k, v in got.items()), file=sys.stderr,
              flush=True)
    print(f"{args.optimizer}, dim {args.dim}, one core, CPU ns per id, median (min-max) of {args.rounds} round(s):")
    report = {"optimizer": args.optimizer, "dim": args.dim, "rounds": rounds, "feeds": {}}
    for feed in FEEDS:
        net = [g[f"feed {feed}"][0] - g["feed step-only"][0] for g in rounds]
        step = [g[f"step {feed}"][0] for g in rounds]
        rate = [g[f"step {feed}"][1] / g["step step-only"][1] for g in rounds]
        print(f"  {feed:<10} feed {spread(net)}; step {spread(step)}; rate / step-only's "
              f"{statistics.median(rate):.2f} ({min(rate):.2f}-{max(rate):.2f})")
        report["feeds"][feed] = {"feed_ns_per_id": statistics.median(net), "step_ns_per_id": statistics.median(step),
                                 "rate_over_step_only": statistics.median(rate)}
    print(json.dumps({"feeds": report}))


if __name__ == "__main__":
    main()
