"""The Criteo-shaped DLRM (examples/dlrm.py) with every table row-wise against the planner's plan
(init(sharding_plan="auto"), docs/guide/sharding.md), alternating in one run (issue 57):

    python examples/dlrm.py write --out DIR --train-samples 131072
    python bench/sharding.py --data DIR [--rounds 2] [--ranks 2] [--steps 24] [--plans none auto PLAN.json ...]
        [--together]

A plan may end in @bfloat16 or @float16 (`auto@bfloat16`): the same plan with every table's rows and
gradients crossing in 16 bits (create_table(exchange_dtype=), examples/dlrm.py --exchange-dtype).

Each configuration is a fresh job on `ranks` MPI ranks that prints examples/dlrm.py's SUMMARY line:
CPU seconds per 1000 samples (all ranks, after the warm-up) and the bytes all ranks sent each other
per step (keys, rows, gradients: the exchanges' own counters). Prints the medians and, per round,
each plan's ratios to the first configuration, then a JSON line of every run (--show-plan prints
the first planned job's plan).

--together (the distribution's share, as bench/scaling.py --together measures it for one table): the
jobs of N ranks are pinned to a core each, and each round also runs N single-rank jobs at once,
rank i pinned to core i, with no exchange between them (the machine's own cost of N copies of the
same per-rank work: a rank's batch is the same size at any world size). The share of a plan is the
copies' CPU time per sample over its N ranks': 1.0 when the distribution costs nothing.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           PYTHONUNBUFFERED="1")
SUMMARY = re.compile(r"SUMMARY .*samples_per_s=(\d+) cpu_s_per_1k_samples=([0-9.]+) wire_kb_per_step=([0-9.]+)"
                     r".*eval_auc=([0-9.]+)")


def one(args, config):
    placed = ["--bind-to", "core", "--map-by", "core"] if args.together else ["--oversubscribe"]
    cmd = [MPIEXEC, *placed, "-np", str(args.ranks), *_train(args, config)]
    return _summary(args, config, subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=1800),
                    cmd)


def _train(args, config):
    plan, _, wire = config.partition("@")
    return [sys.executable, os.path.join(ROOT, "examples", "dlrm.py"), "train", "--data", args.data, "--steps",
            str(args.steps), *([] if plan == "none" else ["--sharding-plan", plan]),
            *(["--exchange-dtype", wire] if wire else [])]


def copies(args):
    """N single-rank jobs at once, job i on core i: their mean CPU ms per 1000 samples and summed rate."""
    cmds = [["taskset", "-c", str(i), *_train(args, "none")] for i in range(args.ranks)]
    with ThreadPoolExecutor(len(cmds)) as pool:
        procs = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT,
                                                         timeout=1800), cmds))
    outs = [_summary(args, "none", proc, cmd) for cmd, proc in zip(cmds, procs)]
    return {"config": f"{args.ranks} single ranks at once",
            "cpu_ms_per_1k": statistics.mean(o["cpu_ms_per_1k"] for o in outs),
            "samples_per_s": sum(o["samples_per_s"] for o in outs), "wire_kb_per_step": 0.0,
            "eval_auc": statistics.mean(o["eval_auc"] for o in outs)}


def _summary(args, config, proc, cmd):
    found = SUMMARY.search(proc.stdout)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    if args.show_plan and config.partition("@")[0] != "none":
        plan = proc.stderr[proc.stderr.find("sharding plan for"):]
        print("\n".join(plan.splitlines()[:34]), flush=True)
        args.show_plan = False
    rate, cpu, wire, auc = (float(x) for x in found.groups())
    return {"config": config, "samples_per_s": rate, "cpu_ms_per_1k": 1e3 * cpu, "wire_kb_per_step": wire,
            "eval_auc": auc}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--show-plan", action="store_true", help="print the first planned job's plan")
    p.add_argument("--plans", nargs="+", default=["none", "auto"],
                   help="init(sharding_plan=) of each configuration: none (every table row-wise), auto, a plan file")
    p.add_argument("--together", action="store_true", help="also N single ranks at once, a core each, no exchange")
    args = p.parse_args()
    runs, alone = [], []
    configs = args.plans
    for r in range(args.rounds):
        for config in configs:
            runs.append(dict(one(args, config), round=r))
            print(json.dumps(runs[-1]), flush=True)
        if args.together:
            alone.append(dict(copies(args), round=r))
            print(json.dumps(alone[-1]), flush=True)
    med = {c: {k: statistics.median(x[k] for x in runs if x["config"] == c)
               for k in ("cpu_ms_per_1k", "wire_kb_per_step", "samples_per_s")} for c in configs}
    print(f"{'sharding_plan':<24} {'CPU ms / 1000 samples':>22} {'KB on the wire / step':>22} {'samples/s':>10}")
    for c in configs:
        print(f"{os.path.basename(c):<24} {med[c]['cpu_ms_per_1k']:>22.1f} {med[c]['wire_kb_per_step']:>22.1f} "
              f"{med[c]['samples_per_s']:>10.0f}")
    base = configs[0]
    for c in configs[1:]:
        pairs = [(a, b) for a, b in zip([x for x in runs if x["config"] == base], [x for x in runs if x["config"] == c])]
        print(f"{os.path.basename(c)} / {base}, per round: CPU "
              + ", ".join(f"{b['cpu_ms_per_1k'] / a['cpu_ms_per_1k']:.2f}" for a, b in pairs)
              + "; bytes " + ", ".join(f"{b['wire_kb_per_step'] / a['wire_kb_per_step']:.2f}" for a, b in pairs))
    for c in configs if alone else []:
        shares = [a["cpu_ms_per_1k"] / x["cpu_ms_per_1k"] for a, x in zip(alone, [x for x in runs if x["config"] == c])]
        print(f"{os.path.basename(c)}: the distribution's share (CPU per sample of {args.ranks} single ranks at once / "
              f"of {args.ranks} ranks) {statistics.median(shares):.2f}, per round "
              + ", ".join(f"{x:.2f}" for x in shares))
    print(json.dumps({"ranks": args.ranks, "steps": args.steps, "runs": runs, "alone": alone}))


if __name__ == "__main__":
    main()
