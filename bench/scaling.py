"""Weak scaling with a core per rank, and where each rank's step time goes, side by side.

    python bench/scaling.py [--rounds 3] [--ranks 2] [sparse_step.py options, e.g. --dim 128 --optimizer sgd]
    python bench/scaling.py --demo [--rounds 3] [examples/wide_deep.py options]      (samples/s of the demo)

Alternates, `--rounds` times, one rank pinned to core 0 (`taskset -c 0`) and N ranks pinned to a core
each (`mpiexec --bind-to core --map-by core -np N`), both with one TensorFlow thread per pool, each
rank training its own 4096 x 26 batches (bench/sparse_step.py). Prints the median of each and the
efficiency (N-rank aggregate / N x one rank) and the CPU time per id of both (every thread of a rank,
the key pipeline's included; N ranks over 1), then the step timeline (rank_runtime/pipeline/step_profile.py)
of the round whose N-rank figure is the median: the 1-rank step beside every rank of the N-rank
step. With --demo the same for the Wide&Deep demo (steady-state samples/s, its last 10 steps
traced). The last line is JSON (for bench/run.py). Needs N cores.

--together adds to each round N single ranks at once, each on its own core and its own batches, with
no exchange between them: what the machine alone takes from N copies of the same work (shared
cache, memory bandwidth, the hypervisor). N ranks against N copies is then what the distribution
itself costs: its exchanges, waits and extra work.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           PYTHONUNBUFFERED="1", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")


def run(cmd, env=None):
    """cmd's last JSON line; env: in place of ENV."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or ENV, cwd=ROOT, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def run_demo(cmd):
    """The demo's samples/s (all ranks) and timeline, in sparse_step.py's JSON shape."""
    with tempfile.TemporaryDirectory() as model_dir:
        proc = subprocess.run(cmd + ["--model-dir", model_dir], capture_output=True, text=True, env=ENV, cwd=ROOT,
                              timeout=900)
    rate = re.search(r"samples_per_s=(\d+)", proc.stdout)
    timeline = [line for line in proc.stdout.splitlines() if line.startswith("TIMELINE ")]
    if proc.returncode != 0 or not rate or not timeline:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return {"ids_per_s": float(rate.group(1)), "timeline": json.loads(timeline[-1][len("TIMELINE "):])}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--timeline", type=int, default=10, help="traced steps per run")
    p.add_argument("--demo", action="store_true", help="the Wide&Deep demo instead of the sparse step")
    p.add_argument("--together", action="store_true", help="also N single ranks at once, a core each, no exchange")
    args, step_args = p.parse_known_args(argv)
    if args.demo:
        step = [sys.executable, "examples/wide_deep.py", "--steps", "400", "--eval-samples", "4096", "--trace-steps",
                str(args.timeline)] + step_args
        measure, unit = run_demo, "samples/s"
    else:
        step = [sys.executable, "bench/sparse_step.py", "--peer", "shardrec", "--timeline", str(args.timeline)] + step_args
        measure, unit = run, "ids/s"
    one_core = ["taskset", "-c", "0"] + step
    n_cores = [MPIEXEC, "--bind-to", "core", "--map-by", "core", "-np", str(args.ranks)] + step
    rounds, together = [], []
    for i in range(args.rounds):
        one, many = measure(one_core), measure(n_cores)
        rounds.append((one, many))
        print(f"round {i + 1}: 1 rank {one['ids_per_s'] / 1e6:.3f}M {unit}, {args.ranks} ranks "
              f"{many['ids_per_s'] / 1e6:.3f}M ({many['ids_per_s'] / args.ranks / one['ids_per_s']:.2f})",
              file=sys.stderr, flush=True)
        if args.together:
            together.append(copies_at_once(measure, step, args.ranks))
            print(f"round {i + 1}: {args.ranks} single ranks at once {together[-1]['ids_per_s'] / 1e6:.3f}M {unit}",
                  file=sys.stderr, flush=True)
    one_rate = statistics.median(r[0]["ids_per_s"] for r in rounds)
    many_rate = statistics.median(r[1]["ids_per_s"] for r in rounds)
    efficiency = many_rate / (args.ranks * one_rate)
    cpu = cpu_per_id(rounds) if not args.demo else None
    median_round = sorted(rounds, key=lambda r: r[1]["ids_per_s"])[len(rounds) // 2]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from shardrec.rank_runtime.pipeline.step_profile import format_columns

    columns = [("1 rank", median_round[0]["timeline"][0])]
    columns += [(f"{args.ranks}: rank {t['rank']}", t) for t in median_round[1]["timeline"]]
    print(f"1 rank on 1 core {one_rate / 1e6:.3f}M {unit}; {args.ranks} ranks on a core each "
          f"{many_rate / 1e6:.3f}M {unit}; efficiency {efficiency:.2f} (medians of {args.rounds} rounds)")
    if cpu:
        print(f"CPU time per id (every thread of a rank): 1 rank {cpu['one_rank']:.1f} ns, {args.ranks} ranks "
              f"{cpu['many_ranks']:.1f} ns (mean of the ranks); {cpu['ratio']:.2f}x (medians of {args.rounds} rounds; "
              f"per round {', '.join(f'{x:.2f}' for x in cpu['ratios'])})")
    machine = report_together(rounds, together, args.ranks, unit, not args.demo) if together else None
    print(format_columns(columns))
    print(json.dumps({"one_rank": one_rate, "ranks": args.ranks, "many_ranks": many_rate, "efficiency": efficiency,
                      "rounds": [[r[0]["ids_per_s"], r[1]["ids_per_s"]] for r in rounds], "together": machine,
                      "timeline": {"one_rank": median_round[0]["timeline"], "many_ranks": median_round[1]["timeline"]},
                      "cpu_ns_per_id": cpu, "unit": unit, "args": step_args}))


def copies_at_once(measure, step, n):
    """N single ranks started together, rank i pinned to core i, each on its own batches: their
    aggregate rate and each one's CPU time per id."""
    with ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(measure, [["taskset", "-c", str(i)] + step + _seed(step, i) for i in range(n)]))
    return {"ids_per_s": sum(o["ids_per_s"] for o in outs),
            "cpu_ns_per_id": [o["cpu_ns_per_id"][0] for o in outs if "cpu_ns_per_id" in o]}


def _seed(step, i):
    """sparse_step.py draws rank i's batches from seed i; a single rank is rank 0, so copy i says so."""
    return ["--seed", str(i)] if "bench/sparse_step.py" in step else []


def report_together(rounds, together, n, unit, with_cpu):
    """The machine's own scaling (N copies at once against one alone) and the distribution's (N
    ranks against N copies at once), rates and CPU time per id, medians over the rounds."""
    machine = statistics.median(t["ids_per_s"] / (n * r[0]["ids_per_s"]) for r, t in zip(rounds, together))
    per_round = [r[1]["ids_per_s"] / t["ids_per_s"] for r, t in zip(rounds, together)]
    distribution = statistics.median(per_round)
    print(f"{n} single ranks at once, a core each, no exchange: efficiency {machine:.2f} (the machine's own); "
          f"{n} ranks against them: {distribution:.2f} ({', '.join(f'{x:.2f}' for x in per_round)}) in {unit}")
    out = {"efficiency": machine, "ranks_over_copies": distribution, "rounds": [t["ids_per_s"] for t in together]}
    if with_cpu:
        copies = [statistics.mean(t["cpu_ns_per_id"]) for t in together]
        one = [r[0]["cpu_ns_per_id"][0] for r in rounds]
        many = [statistics.mean(r[1]["cpu_ns_per_id"]) for r in rounds]
        cpu_machine = statistics.median(c / o for c, o in zip(copies, one))
        cpu_rounds = [m / c for m, c in zip(many, copies)]
        cpu_distribution = statistics.median(cpu_rounds)
        print(f"CPU time per id: {n} copies at once {statistics.median(copies):.1f} ns, {cpu_machine:.2f}x one alone; "
              f"{n} ranks {cpu_distribution:.2f}x the copies ({', '.join(f'{x:.2f}' for x in cpu_rounds)})")
        out.update(cpu_ns_per_id=statistics.median(copies), cpu_over_one=cpu_machine,
                   cpu_ranks_over_copies=cpu_distribution, cpu_rounds=cpu_rounds)
    return out


def cpu_per_id(rounds):
    """CPU time per id at 1 rank and at N (each rank's own ids, the ranks' mean), medians over the
    rounds, and their ratio per round: what N ranks pay per id beyond one, which the VM's run-to-run
    drift of throughput does not move as much."""
    one = [r[0]["cpu_ns_per_id"][0] for r in rounds]
    many = [statistics.mean(r[1]["cpu_ns_per_id"]) for r in rounds]
    ratios = [m / o for o, m in zip(one, many)]
    return {"one_rank": statistics.median(one), "many_ranks": statistics.median(many),
            "ratio": statistics.median(ratios), "ratios": ratios}


if __name__ == "__main__":
    main()
