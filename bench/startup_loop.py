"""Starts a short 2-rank job again and again, to catch a start-up hang that shows once in many runs.

    python bench/startup_loop.py [--runs 300] [--ranks 2] [--busy] [--timeout 120] [--out DIR]
                                 [-- JOB ARGS...]

Each run is `mpiexec --oversubscribe -np RANKS python JOB ARGS` (default: the Wide&Deep demo, 5
steps on small data: init, Horovod, the key pipeline, the row exchanges' communicators, the first
steps, a save, an evaluation and the exit). --busy keeps one core spinning meanwhile (a process at
full load beside the job, as a CI machine's other work). A run still going after --timeout seconds
counts as hung: every rank's Python stacks (SIGUSR1, which init() registers) and its native
threads' stacks (gdb, when installed) go to OUT/hung-<run>.txt before the job is killed, and the
loop goes on. Prints one line per run and a summary: runs, hung, failed, start-up time median/max.
"""
import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

from shardrec.orchestrator import job_kill

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEMO = [os.path.join(ROOT, "examples", "wide_deep.py"), "--steps", "5", "--batch-size", "64", "--eval-samples", "512",
        "--warmup-steps", "0", "--log-every", "1"]


def _spin():
    while True:
        pass


def _native_stacks(pid):
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(gdb not installed: no native stacks)\n"
    proc = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"], capture_output=True,
                          text=True, timeout=120)
    return proc.stdout[-60000:]


def _dump_hung(proc, path):
    """Every rank's Python and native stacks into `path`; then the job is killed and its shared
    memory removed."""
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "python" in p.name()]
    job_kill.ask_for_stacks(ranks)
    time.sleep(3)
    native = {r.pid: _native_stacks(r.pid) for r in ranks}
    job_kill.kill_job([psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True))
    out, err = proc.communicate()
    with open(path, "w") as f:
        f.write(f"STDOUT\n{out}\nSTDERR\n{err}\n")
        for pid, text in native.items():
            f.write(f"\nNATIVE STACKS of pid {pid}\n{text}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=300)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--busy", action="store_true", help="keep one core spinning meanwhile")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds after which a run counts as hung")
    p.add_argument("--out", default=None, help="where the stacks of hung runs go (default: a temporary folder)")
    p.add_argument("job", nargs="*", help="the job and its arguments after -- (default: the demo, 5 steps)")
    a = p.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="shardrec-startup-")
    os.makedirs(out, exist_ok=True)
    job = a.job or DEMO
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONUNBUFFERED="1")
    spinner = multiprocessing.Process(target=_spin, daemon=True) if a.busy else None
    if spinner:
        spinner.start()
    times, hung, failed = [], [], []
    try:
        for run in range(a.runs):
            model_dir = tempfile.mkdtemp(prefix="startup-model-", dir=out)
            args = [x.replace("{model_dir}", model_dir) for x in job]
            if job is DEMO:
                args += ["--model-dir", model_dir]
            with tempfile.TemporaryDirectory(prefix="shardrec-mpi-") as session:
                started = time.monotonic()
                proc = subprocess.Popen([mpiexec, "--oversubscribe", "-np", str(a.ranks), sys.executable, *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env=dict(env, TMPDIR=session), cwd=ROOT)
                try:
                    _, err = proc.communicate(timeout=a.timeout)
                    seconds = time.monotonic() - started
                    if proc.returncode != 0:
                        failed.append(run)
                        with open(os.path.join(out, f"failed-{run}.txt"), "w") as f:
                            f.write(err)
                    times.append(seconds)
                    status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
                except subprocess.TimeoutExpired:
                    hung.append(run)
                    _dump_hung(proc, os.path.join(out, f"hung-{run}.txt"))
                    status, seconds = "HUNG", a.timeout
            shutil.rmtree(model_dir, ignore_errors=True)
            print(f"run {run + 1}/{a.runs}: {status} in {seconds:.1f} s (hung so far: {len(hung)}, failed: "
                  f"{len(failed)})", flush=True)
    finally:
        if spinner:
            spinner.terminate()
    median = statistics.median(times) if times else float("nan")
    print(f"SUMMARY runs={a.runs} ranks={a.ranks} busy={a.busy} hung={len(hung)} {hung} failed={len(failed)} "
          f"{failed} seconds_median={median:.1f} seconds_max={max(times, default=float('nan')):.1f} out={out}")
    return 1 if hung or failed else 0


if __name__ == "__main__":
    sys.exit(main())
