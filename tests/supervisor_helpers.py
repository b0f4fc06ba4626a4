"""Runs the supervisor's test job (tests/mpi_jobs/supervised_train.py) under `shardrec-run`, and
compares what it leaves with an uninterrupted run's."""
import json
import os
import subprocess
import sys

import numpy as np
import psutil

from mpi_helpers import INIT_DEFAULTS, JOBS

RUN = os.path.join(os.path.dirname(sys.executable), "shardrec-run")
JOB = os.path.join(JOBS, "supervised_train.py")


def run_env(fault=None, **extra):
    """This process's environment for a supervised job, without what an in-process init() set."""
    env = {k: v for k, v in os.environ.items() if k not in INIT_DEFAULTS and k != "FAULT"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="2", **extra)
    if fault:
        env["FAULT"] = fault
    return env


def shardrec_run(*args, fault=None, timeout=300, cwd=None, prefix=(), env=None):
    """`shardrec-run ARGS`, run through `prefix` (e.g. a test host's agent) if given; `env`: variables added."""
    return subprocess.run([*prefix, RUN, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=run_env(fault, **(env or {})), cwd=cwd)


def job_args(tmp, name, extra=()):
    """(shardrec-run arguments for the test job, its output directory, its run directory)."""
    ckpt, out, run = tmp / f"{name}-ckpt", tmp / f"{name}-out", tmp / f"{name}-run"
    out.mkdir()
    # A restart waits 1 s here (5 s by default): the tests restart many times.
    delay = [] if "--restart-delay" in extra else ["--restart-delay", 1]
    args = ["-np", 2, "--checkpoint-dir", ckpt, "--run-dir", run, *delay, *extra, "--", sys.executable, JOB, ckpt, out]
    return args, out, run


def train(tmp, name, fault=None, extra=(), prefix=(), env=None):
    args, out, run = job_args(tmp, name, extra)
    return shardrec_run(*args, fault=fault, prefix=prefix, env=env), out, run


def assert_same_final_state(out, reference):
    for rank in (0, 1):
        got, want = np.load(out / f"final-rank{rank}.npz"), np.load(reference / f"final-rank{rank}.npz")
        assert int(got["step"]) == int(want["step"]) == 30
        np.testing.assert_allclose(got["w"], want["w"], atol=1e-5)
        assert sorted(got["keys"].tolist()) == sorted(want["keys"].tolist())
        got_rows = dict(zip(got["keys"].tolist(), got["rows"]))
        for key, row in zip(want["keys"].tolist(), want["rows"]):
            np.testing.assert_allclose(got_rows[key], row, atol=1e-5, err_msg=f"rank {rank} key {key}")


def attempt_pids(run, attempt):
    """The pids of the ranks of an attempt, from their last heartbeats."""
    directory = run / f"attempt-{attempt}" / "heartbeat"
    return [json.loads((directory / name).read_text())["pid"] for name in os.listdir(directory)
            if name.endswith(".json")]


def assert_gone(pids):
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid

