"""Runs a job under a real `mpiexec` (the virtual environment's Open MPI), oversubscribed."""
import os
import subprocess
import sys
import tempfile

INIT_DEFAULTS = ("OMPI_MCA_mpi_yield_when_idle", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "HOROVOD_CYCLE_TIME",
                 "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_jobs")


def mpiexec(nprocs, job, *args, timeout=300, cwd=None, env=None, wrapper=None):
    """Runs `job` (a path, or a file name in tests/mpi_jobs) on `nprocs` ranks; returns the CompletedProcess.
    `env`: variables added to this process's environment; `wrapper`: a command each rank runs under
    (prlimit, unshare)."""
    launcher = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    # init() in this test process sets defaults for its own ranks (thread pools, Horovod's stall
    # limits): a job must choose its own, not inherit them.
    inherited = {k: v for k, v in os.environ.items() if k not in INIT_DEFAULTS}
    env = dict(inherited, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [launcher, "--oversubscribe", "-np", str(nprocs), *(wrapper or ()), sys.executable, os.path.join(JOBS, job) if not os.path.isabs(job) else job, *map(str, args)]
    # Open MPI's session files in a directory of this run's own (see launch/mpirun.sh): a run killed
    # by a test must not leave files that a later mpiexec with the same PID trips over.
    with tempfile.TemporaryDirectory(prefix="shardrec-mpi-") as tmp:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(env, TMPDIR=tmp), cwd=cwd)


def check(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
    return proc
