"""Runs a job under a real `mpiexec` (the virtual environment's Open MPI), oversubscribed."""
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

from shardrec.orchestrator import job_kill

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
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env, TMPDIR=tmp),
                                cwd=cwd)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            left = _processes_of(proc)
            out, err = _stacks_of_hung(proc)
            raise AssertionError(f"{' '.join(cmd)}: still running after {timeout} s ({left}); every live rank's Python "
                                 f"stacks (SIGUSR1) are at the end of its stderr\nSTDOUT:\n{out[-4000:]}\nSTDERR:\n"
                                 f"{err[-20000:]}") from None
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_and_clean(processes):
    """SIGKILLs `processes` and removes the shared-memory segments of their job, which a killed
    mpiexec cannot."""
    alive, _ = job_kill.kill_job(processes, timeout=30)
    assert not alive, f"processes {[p.pid for p in alive]} survived SIGKILL"


def segments_left_behind(before: set, settle_s: float = 10.0) -> set:
    """Shared-memory segments that appeared since `before` and belong to no job that a live process
    maps a segment of: what a job that ended left in /dev/shm. Other jobs may run beside (another
    test run, a user's job): theirs are not counted while they run, and one that just ended gets
    `settle_s` for its daemon to remove its own."""
    deadline = time.monotonic() + settle_s
    while True:
        live = tuple(os.path.basename(p) for p in job_kill.job_prefixes(psutil.pids()))
        left = {s for s in job_kill.segments_now() - before if not s.startswith(live)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _processes_of(proc):
    """The launcher's processes and their states: whether the ranks or the launcher itself hang (a
    rank left a zombie means the launcher stopped reaping its children)."""
    found = []
    try:
        launcher = psutil.Process(proc.pid)
        processes = [launcher] + launcher.children(recursive=True)
    except psutil.Error:
        return "the launcher has just exited"
    for p in processes:
        try:
            found.append(f"{p.name()} {p.pid} {p.status()}")
        except psutil.Error:
            pass
    return ", ".join(found)


def _stacks_of_hung(proc):
    """Makes every rank of a hung job write its threads' stacks (init() registers SIGUSR1 for that),
    then ends the job; returns its whole output, so that a hang seen once says where it was."""
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "python" in p.name()]
    job_kill.ask_for_stacks(ranks)
    time.sleep(3)
    _kill_and_clean([psutil.Process(proc.pid)] + ranks)
    return proc.communicate()


def _session_of(process):
    try:
        return os.getsid(process.pid)
    except (OSError, psutil.Error):
        return None


def check(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
    return proc


def kill_during_save(nprocs, job, args, sparse_dir, timeout=240):
    """Runs `job` (in tests/mpi_jobs) on `nprocs` ranks and kills every rank and mpiexec (SIGKILL)
    as soon as a shard of the save into `sparse_dir` is being written (its .tmp- directory is
    there, in the save's staging directory); fails when the job ended before."""
    staging = os.path.join(os.path.dirname(sparse_dir), f".{os.path.basename(sparse_dir)}.saving")
    launcher = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    # The killed mpiexec's session files go to a short directory of their own, removed below
    # (mpiexec() says why; Unix socket paths under pytest's tmp_path could be too long).
    session_files = tempfile.mkdtemp(prefix="shardrec-mpi-")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="2",
               TMPDIR=session_files)
    proc = subprocess.Popen([launcher, "--oversubscribe", "-np", str(nprocs), sys.executable, os.path.join(JOBS, job),
                             *map(str, args)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if any(e.startswith(".tmp-") for e in os.listdir(staging)):
                break
        except FileNotFoundError:
            pass
        time.sleep(0.005)
    running = proc.poll() is None
    # Open MPI puts each rank in a process group of its own: killing mpiexec's group would leave
    # the ranks running (and a lone rank finishing its save), so every process of the session goes.
    _kill_and_clean([p for p in psutil.process_iter() if _session_of(p) == proc.pid])
    proc.wait()
    shutil.rmtree(session_files, ignore_errors=True)
    assert running, "the job ended before its save began"


def small_disk(path, megabytes):
    """A tmpfs of `megabytes` at `path` (root), or a command prefix that makes one in a user and
    mount namespace of the job's own where this process may not mount."""
    path.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(path)],
                          capture_output=True)
    if made.returncode == 0:
        return None
    return ["unshare", "--map-root-user", "--mount", "sh", "-c",
            f"mount -t tmpfs -o size={megabytes}m tmpfs {path} && exec \"$0\" \"$@\""]
