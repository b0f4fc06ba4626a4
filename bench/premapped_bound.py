"""How far one rank can get ahead of TensorFlow's pre-mapped variable on a user's feed, at best.

    python bench/premapped_bound.py [--rounds 3] [--optimizers lazy_adam sgd] [--dim 16] [--core 1]

Every peer on the records feed pays for parsing its batch before its step, and shardrec's step
cannot cost less per id than the single-core loop (bench/limit.py). So no rank can beat the peer
by more than  peer / (loop + feed):  the peer's CPU time per id over the loop's plus the feed's.
Each round runs, pinned to one core, on the loop's own keys (the "steady" window: 100 batches
after a full pass, as bench/limit.py): the loop; then bench/sparse_step.py on the records feed for
shardrec, tf_premapped, and the feed alone as each of them reads it (feed_ids: the keys, which
shardrec parses; feed_rows: the pre-mapped rows, which the peer parses). Prints, per optimizer,
the medians and spreads of CPU time per id, the ratio reached (peer / shardrec), the bound
(peer / (loop + feed_ids)), shardrec's step beyond its feed against the loop, and the step that
issue 42's target would need (peer / target - feed_ids) against the loop, then one JSON line.
"""
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from limit import WINDOWS, arguments, build, loop, spread  # noqa: E402
from scaling import run as json_line  # noqa: E402

PEERS = ("shardrec", "tf_premapped", "feed_ids", "feed_rows")
# Issue 42's targets for one rank against tf_premapped on this feed.
TARGETS = {"lazy_adam": 2.5, "sgd": 1.5}


def on_records(peer, keys, core, optimizer, dim):
    warmup, steps, windows = WINDOWS["steady"]
    out = json_line(["taskset", "-c", str(core), sys.executable, "bench/sparse_step.py", "--peer", peer,
                     "--feed", "records", "--keys-file", keys, "--optimizer", optimizer, "--dim", str(dim),
                     "--warmup", str(warmup), "--steps", str(steps), "--windows", str(windows)])
    return out["cpu_ns_per_id"][0]


def one_round(binary, keys, core, optimizer, dim):
    ns = {"loop": loop(binary, keys, core, optimizer, dim)["steady"][0]}
    for peer in PEERS:
        ns[peer] = on_records(peer, keys, core, optimizer, dim)
    return ns


def derived(ns, optimizer):
    """reached: peer / shardrec; bound: peer / (loop + feed); step_over_loop: shardrec's step
    beyond its feed over the loop; needed: the step's CPU per id the target asks for (peer / target
    less the feed), and the loop over it (above 1: the loop itself is too slow for the target)."""
    needed = ns["tf_premapped"] / TARGETS[optimizer] - ns["feed_ids"]
    return {"reached": ns["tf_premapped"] / ns["shardrec"],
            "bound": ns["tf_premapped"] / (ns["loop"] + ns["feed_ids"]),
            "step_over_loop": (ns["shardrec"] - ns["feed_ids"]) / ns["loop"],
            "needed_ns": needed, "loop_over_needed": ns["loop"] / needed if needed > 0 else float("inf")}


def main(argv=None):
    args = arguments(__doc__).parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    binary, keys = build(args.work)
    rounds = {o: [] for o in args.optimizers}
    for r in range(args.rounds):
        for optimizer in args.optimizers:
            ns = one_round(binary, keys, args.core, optimizer, args.dim)
            rounds[optimizer].append(ns)
            print(f"round {r + 1} {optimizer}: " + ", ".join(f"{k} {v:.1f}" for k, v in ns.items()) + " ns/id; " +
                  ", ".join(f"{k} {v:.2f}" for k, v in derived(ns, optimizer).items()), file=sys.stderr, flush=True)
    report = []
    for optimizer, measured in rounds.items():
        print(f"{optimizer}, dim {args.dim}, CPU ns per id, median (min-max) of {len(measured)} round(s):")
        for who in ("loop",) + PEERS:
            print(f"  {who:<16} {spread([ns[who] for ns in measured])}")
        per_round = [derived(ns, optimizer) for ns in measured]
        ratios = {k: [d[k] for d in per_round] for k in per_round[0]}
        for k, values in ratios.items():
            print(f"  {k:<16} {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        report.append({"optimizer": optimizer, "dim": args.dim, "rounds": measured,
                       **{k: statistics.median(v) for k, v in ratios.items()}})
    print(json.dumps({"premapped_bound": report}))


if __name__ == "__main__":
    main()
