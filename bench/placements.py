"""One table under each placement, alternating in one run: CPU time per id of the sparse step on N
ranks (bench/sparse_step.py's shardrec peer, its --sharding), so that what the planner's cost model
says of a placement can be checked against what it costs (docs/guide/sharding.md):

    python bench/placements.py [--rounds 3] [--ranks 2] [--placements row_wise replicated column_wise]
        [sparse_step.py options, e.g. --dim 128 --distinct 2000 --feed step-only]

Each round runs every placement once, in order, as a fresh `mpiexec -np N` job. Prints, per
placement, the median over rounds of the CPU time per id (all ranks' threads, the key pipeline's
included) and of the aggregate ids/s, each round's ratio to the first placement, then a JSON line of
every run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           PYTHONUNBUFFERED="1")


def one(ranks, placement, rest):
    cmd = [MPIEXEC, "--oversubscribe", "-np", str(ranks), sys.executable, os.path.join(ROOT, "bench", "sparse_step.py"),
           "--peer", "shardrec", "--sharding", placement, *rest]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads(lines[-1])
    cpu = out["cpu_ns_per_id"]
    return {"placement": placement, "ids_per_s": out["ids_per_s"],
            "cpu_ns_per_id": sum(cpu) / len(cpu) if isinstance(cpu, list) else cpu}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--placements", nargs="+", default=["row_wise", "replicated", "column_wise"])
    args, rest = p.parse_known_args()
    runs = []
    for r in range(args.rounds):
        got = [one(args.ranks, placement, rest) for placement in args.placements]
        runs += got
        first = got[0]["cpu_ns_per_id"]
        print(f"round {r + 1}: " + ", ".join(f"{g['placement']} {g['cpu_ns_per_id'] / first:.2f}x" for g in got),
              flush=True)
    print(f"{'placement':<14} {'CPU ns / id':>12} {'ids/s':>12}")
    for placement in args.placements:
        mine = [g for g in runs if g["placement"] == placement]
        print(f"{placement:<14} {statistics.median(g['cpu_ns_per_id'] for g in mine):>12.0f} "
              f"{statistics.median(g['ids_per_s'] for g in mine):>12.0f}")
    print(json.dumps({"ranks": args.ranks, "options": rest, "runs": runs}))


if __name__ == "__main__":
    main()
