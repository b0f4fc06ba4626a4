"""launch/mpirun.sh, the plain Open MPI launch without the supervisor: a job runs, a bad hostfile is
named, and a launcher that outlives its ranks is killed: a real one frozen, and a stand-in for one that
hangs after its ranks ended, holding them as zombies or after reaping them."""
import os
import re
import subprocess
import sys

import psutil
import pytest

from mpi_helpers import JOBS
from supervisor_helpers import run_env
from waits import wait_for


def test_plain_mpirun_script_runs_a_job_without_the_supervisor(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = run_env()
    proc = subprocess.run(["bash", os.path.join(root, "launch", "mpirun.sh"), "2", "--", sys.executable,
                           os.path.join(JOBS, "global_size.py")], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.findall(r"SIZES rank=\d local=(\d+) global=(\d+)", proc.stdout) == [("40", "80")] * 2
    bad = subprocess.run(["bash", os.path.join(root, "launch", "mpirun.sh"), "2", "/nonexistent/hosts", "--", "true"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "hostfile /nonexistent/hosts cannot be read" in bad.stderr


def _children(pid):
    """The live processes under `pid`; one that ends while it is read (the watcher's ps) is left out."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            found.append((p, p.cmdline(), p.create_time()))
        except psutil.Error:
            pass
    return found


def test_plain_mpirun_script_kills_a_launcher_that_outlives_its_ranks():
    """Open MPI's launcher deadlocked as it ended a job leaves its ranks unreaped and never exits; a
    frozen launcher (SIGSTOP once its two ranks run) whose ranks are then killed does the same, for
    certain. The script kills it SHARDREC_LAUNCHER_HANG_S after its ranks ended and fails saying why."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(["bash", os.path.join(root, "launch", "mpirun.sh"), "2", "--", sys.executable, "-c",
                             "import signal; signal.pause()"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=run_env(SHARDREC_LAUNCHER_HANG_S="3"))
    found = []

    def launcher_with_its_ranks():
        for child in psutil.Process(proc.pid).children():  # the script's watcher is a child too
            try:
                if child.name() in ("prterun", "mpiexec") and len(child.children()) == 2:
                    found[:] = [child, child.children()]
                    return True
            except psutil.Error:  # a child of a moment (the watcher's ps) gone meanwhile
                pass
        return False

    wait_for(launcher_with_its_ranks, proc, 60, "mpiexec started with its 2 ranks")
    launcher, ranks = found
    launcher.suspend()
    try:
        for rank in ranks:
            rank.kill()  # zombies: their launcher cannot reap them
        _, err = proc.communicate(timeout=60)
    finally:  # a script that did not kill it must not leave a frozen launcher to the next tests
        if proc.poll() is None:
            proc.kill()
        if launcher.is_running():
            launcher.kill()
    assert proc.returncode == 1, err[-3000:]
    assert (f"launch/mpirun.sh: mpiexec (pid {launcher.pid}) still runs 3 s after every rank it started here ended "
            "(Open MPI's launcher deadlocked ending the job") in err
    assert not launcher.is_running() or launcher.status() == psutil.STATUS_ZOMBIE


# Stands in for a launcher that hangs, deaf to SIGTERM, once its rank ended: STAND_IN=zombie never
# reaps it, STAND_IN=gone reaps it. Skips mpiexec's options and runs the command as the rank.
_STAND_IN = """
import os, signal, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args = args[2:] if args[0] in ("-np", "-x", "--hostfile", "--bind-to") else args[1:]
signal.signal(signal.SIGTERM, signal.SIG_IGN)
rank = subprocess.Popen(args)
if os.environ["STAND_IN"] == "gone":
    rank.wait()
while True:
    signal.pause()
"""


@pytest.mark.parametrize("ended", ["zombie", "gone"])
def test_plain_mpirun_script_kills_a_launcher_whose_ranks_ended(tmp_path, ended):
    """The script installed beside a stand-in launcher (what a real one cannot be made to do on
    demand). zombie: a rank that ends at once, so the watcher only ever lists it as a zombie. gone:
    a rank killed, and reaped, once the watcher has polled while it ran (two of its 0.5 s sleeps
    begun after the rank). Either way the launcher is killed SHARDREC_LAUNCHER_HANG_S later, exit 1."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "launch").mkdir()
    script = tmp_path / "launch" / "mpirun.sh"
    script.write_text(open(os.path.join(root, "launch", "mpirun.sh")).read())
    launcher = tmp_path / ".venv" / "bin" / "mpiexec"
    launcher.parent.mkdir(parents=True)
    launcher.write_text(f"#!{sys.executable}" + _STAND_IN)
    launcher.chmod(0o755)
    rank = ["true"] if ended == "zombie" else ["sleep", "300"]
    proc = subprocess.Popen(["bash", str(script), "1", "--", *rank], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=run_env(SHARDREC_LAUNCHER_HANG_S="2", STAND_IN=ended))
    found, polls = [], set()

    def started():
        found[:] = [(p, t) for p, cmd, t in _children(proc.pid) if cmd[1:2] == [str(launcher)]]
        return bool(found) and (ended == "zombie" or any(cmd == rank for _, cmd, _ in _children(found[0][0].pid)))

    def watcher_polled_twice_since_the_rank_began():
        began = min(t for _, cmd, t in _children(proc.pid) if cmd == rank)
        polls.update(p.pid for p, cmd, t in _children(proc.pid) if cmd == ["sleep", "0.5"] and t >= began)
        return len(polls) >= 2

    try:
        wait_for(started, proc, 60, "the stand-in launcher and its rank")
        stand_in = found[0][0]
        if ended == "gone":
            wait_for(watcher_polled_twice_since_the_rank_began, proc, 60, "two polls of the watcher")
            for p, cmd, _ in _children(stand_in.pid):
                if cmd == rank:
                    p.kill()
        _, err = proc.communicate(timeout=60)
    finally:  # a script that did not kill it must not leave it (or its watcher, or the rank) to the next tests
        if proc.poll() is None:
            left = [p for p, _, _ in _children(proc.pid)]
            proc.kill()
            for p in left:
                p.kill()
    assert proc.returncode == 1, err[-3000:]
    assert f"mpiexec (pid {stand_in.pid}) still runs 2 s after every rank it started here ended" in err, err[-3000:]
    assert not stand_in.is_running() or stand_in.status() == psutil.STATUS_ZOMBIE
