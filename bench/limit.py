"""One rank against the single-core loop, in CPU time per id, alternating in one run.

    python bench/limit.py [--rounds 3] [--optimizers lazy_adam sgd] [--dim 16] [--core 1] [--before TREE]

The loop (bench/limit/ideal_step.cc, a copy of ../shared/limit/ideal_step.cc that also reports CPU
time) is built here with g++ -O3 -march=native, and its keys (50 batches of 4096 x 26 Zipf-1.1 keys
folded into 10M, ../shared/limit/gen_keys.py) drawn here, both kept under the temporary directory.
Each round runs, pinned to the same core (`taskset -c CORE`), for each optimizer: the loop, then one
shardrec rank (bench/sparse_step.py --feed step-only --keys-file, one TensorFlow thread per pool) on
the loop's own keys, in the loop's two windows: "first" (30 batches on a growing table after 10)
and "steady" (100 batches after a full pass). CPU time per id counts every thread of the process
(the rank's key pipeline included); on one pinned core it is the wall time less what others took.
Prints each figure's median and spread (min-max over rounds) and the ratio loop / rank (1 = the
rank does what the loop does per id; above 1, less), then one JSON line.
--before TREE: a checkout of an earlier commit (its native libraries built, or copied when native/
did not change): each round also runs its rank right after this tree's, and the table adds its
CPU per id and the ratio before / now (above 1: this tree spends less per id).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from scaling import ENV, run as json_line  # noqa: E402

# The rank's runs in the loop's windows: (warm-up steps, timed steps, windows).
WINDOWS = {"first": (10, 30, 3), "steady": (50, 100, 4)}


def build(work):
    """The loop's binary and keys, made once per machine."""
    binary, keys = os.path.join(work, "ideal_step"), os.path.join(work, "keys_fold.npy")
    source = os.path.join(HERE, "limit", "ideal_step.cc")
    if not os.path.exists(binary) or os.path.getmtime(binary) < os.path.getmtime(source):
        subprocess.run(["g++", "-O3", "-march=native", "-std=c++17", source, "-o", binary + ".tmp"], check=True)
        os.replace(binary + ".tmp", binary)
    if not os.path.exists(keys):
        np.save(keys + ".tmp.npy", loop_keys())
        os.replace(keys + ".tmp.npy", keys)
    return binary, keys


def loop_keys():
    """gen_keys.py's "fold" keys: the same generator, seed and folding."""
    rng = np.random.default_rng(12345)
    z = rng.zipf(1.1, size=(50, 4096, 26)).astype(np.int64)
    z = ((z - 1) % 10_000_000) + 1
    return (z * np.int64(2654435761)) % np.int64(2**40)


def loop(binary, keys, core, optimizer, dim):
    out = json_line(["taskset", "-c", str(core), binary, keys, optimizer, str(dim), "8"])
    return {"first": (out["first_cpu_ns"], out["first"]), "steady": (out["steady_cpu_ns"], out["steady"])}


def rank(keys, core, optimizer, dim, window, tree=None):
    """One rank's (CPU ns per id, ids/s); tree: another checkout's shardrec and bench/sparse_step.py."""
    warmup, steps, windows = WINDOWS[window]
    script, env = "bench/sparse_step.py", None
    if tree is not None:
        script, env = os.path.join(tree, "bench", "sparse_step.py"), dict(ENV, PYTHONPATH=_package_path(tree))
    out = json_line(["taskset", "-c", str(core), sys.executable, script, "--peer", "shardrec",
                     "--feed", "step-only", "--keys-file", keys, "--optimizer", optimizer, "--dim", str(dim),
                     "--warmup", str(warmup), "--steps", str(steps), "--windows", str(windows)], env=env)
    return out["cpu_ns_per_id"][0], out["ids_per_s"]


def _package_path(tree):
    """A folder whose `shardrec` is `tree` (the editable install names this checkout; a path entry
    is searched before it)."""
    folder = os.path.join(tempfile.gettempdir(), "shardrec-bench-before", f"{zlib.crc32(os.path.abspath(tree).encode()):08x}")
    os.makedirs(folder, exist_ok=True)
    link = os.path.join(folder, "shardrec")
    if not os.path.islink(link):
        os.symlink(os.path.abspath(tree), link)
    return folder


def spread(values):
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def arguments(doc):
    """The options of every run against the loop (this script's and premapped_bound.py's)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--optimizers", nargs="+", choices=["lazy_adam", "sgd"], default=["lazy_adam", "sgd"])
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--core", type=int, default=1)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "shardrec-bench-limit"))
    return p


def main(argv=None):
    p = arguments(__doc__)
    p.add_argument("--windows", nargs="+", choices=sorted(WINDOWS), default=["steady", "first"])
    p.add_argument("--before", help="a checkout of an earlier commit, run after this tree's rank in every round")
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    binary, keys = build(args.work)
    # figures[(optimizer, window, who)] = [(cpu ns per id, ids/s) per round]
    figures = {}
    for r in range(args.rounds):
        for optimizer in args.optimizers:
            for window, measured in loop(binary, keys, args.core, optimizer, args.dim).items():
                figures.setdefault((optimizer, window, "loop"), []).append(measured)
            for window in args.windows:
                figures.setdefault((optimizer, window, "rank"), []).append(
                    rank(keys, args.core, optimizer, args.dim, window))
                loop_ns, rank_ns = figures[(optimizer, window, "loop")][-1][0], figures[(optimizer, window, "rank")][-1][0]
                before = ""
                if args.before:
                    figures.setdefault((optimizer, window, "before"), []).append(
                        rank(keys, args.core, optimizer, args.dim, window, args.before))
                    before = f", before {figures[(optimizer, window, 'before')][-1][0]:.1f} ns/id"
                print(f"round {r + 1} {optimizer} {window}: loop {loop_ns:.1f} ns/id, rank {rank_ns:.1f} ns/id, "
                      f"ratio {loop_ns / rank_ns:.2f}{before}", file=sys.stderr, flush=True)
    report = []
    print(f"{'optimizer':<10} {'window':<7} {'loop ns/id':<20} {'rank ns/id':<20} {'loop M ids/s':<14} "
          f"{'rank M ids/s':<14} ratio (per round)")
    for optimizer in args.optimizers:
        for window in args.windows:
            lo, ra = figures[(optimizer, window, "loop")], figures[(optimizer, window, "rank")]
            ratios = [a[0] / b[0] for a, b in zip(lo, ra)]
            print(f"{optimizer:<10} {window:<7} {spread([x[0] for x in lo]):<20} {spread([x[0] for x in ra]):<20} "
                  f"{statistics.median(x[1] for x in lo) / 1e6:<14.2f} {statistics.median(x[1] for x in ra) / 1e6:<14.2f} "
                  f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})")
            row = {"optimizer": optimizer, "window": window, "dim": args.dim, "ratio": statistics.median(ratios),
                   "ratios": ratios, "loop": lo, "rank": ra}
            if args.before:
                be = figures[(optimizer, window, "before")]
                row["before"], row["before_over_now"] = be, [b[0] / a[0] for a, b in zip(ra, be)]
                print(f"{'':<18} before: {spread([x[0] for x in be])} ns/id, before / now "
                      f"{statistics.median(row['before_over_now']):.3f} "
                      f"({', '.join(f'{x:.3f}' for x in row['before_over_now'])})")
            report.append(row)
    print(json.dumps({"limit": report}))


if __name__ == "__main__":
    main()
