"""launch/mpirun.sh, the plain Open MPI launch without the supervisor: a job runs, a bad hostfile is
named, and a launcher that outlives its ranks is killed."""
import os
import re
import subprocess
import sys

import psutil

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


# A rank that ends once its launcher is stopped (SIGSTOP: state T in /proc/PID/stat, after the
# command name in parentheses), or after 60 s, when the test has failed already.
_UNTIL_THE_LAUNCHER_STOPS = """
import os, time
stat, deadline = f"/proc/{os.getppid()}/stat", time.monotonic() + 60
while open(stat).read().rpartition(")")[2].split()[0] != "T" and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def test_plain_mpirun_script_kills_a_launcher_that_outlives_its_ranks():
    """Open MPI's launcher deadlocked as it ended a job leaves its ranks unreaped and never exits; a
    frozen launcher (SIGSTOP once its two ranks run) does the same, for certain. Its ranks end as
    soon as it stops, within one of the script's polls (the watcher sees them only as zombies). The
    script kills it SHARDREC_LAUNCHER_HANG_S after its ranks ended and fails saying why."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(["bash", os.path.join(root, "launch", "mpirun.sh"), "2", "--", sys.executable, "-c",
                             _UNTIL_THE_LAUNCHER_STOPS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=run_env(SHARDREC_LAUNCHER_HANG_S="3"))
    found = []

    def launcher_with_its_ranks():
        for child in psutil.Process(proc.pid).children():  # the script's watcher is a child too
            try:
                if child.name() in ("prterun", "mpiexec") and len(child.children()) == 2:
                    found[:] = [child]
                    return True
            except psutil.Error:  # a child of a moment (the watcher's ps) gone meanwhile
                pass
        return False

    wait_for(launcher_with_its_ranks, proc, 60, "mpiexec started with its 2 ranks")
    launcher = found[0]
    launcher.suspend()
    try:
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


# Stands in for a launcher that reaps its ranks and then never exits, deaf to SIGTERM (what the
# watcher must also catch: every rank gone, not only zombies). Skips mpiexec's options, runs the
# command, then becomes a sleep with no children.
_REAPING_HUNG_LAUNCHER = """#!/usr/bin/env bash
echo $$ > "${0%/*}/launcher.pid"
while [ $# -gt 0 ] && [[ "$1" == -* ]]; do case "$1" in -np|-x|--hostfile|--bind-to) shift 2;; *) shift;; esac; done
"$@"
trap '' TERM
exec sleep 600
"""


def test_plain_mpirun_script_kills_a_launcher_whose_ranks_are_gone(tmp_path):
    """The script as installed beside a launcher that reaped its one rank (a process of 2 s, seen by
    the watcher's 0.5 s polls) and hangs: killed SHARDREC_LAUNCHER_HANG_S later, exit 1."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "launch").mkdir()
    script = tmp_path / "launch" / "mpirun.sh"
    script.write_text(open(os.path.join(root, "launch", "mpirun.sh")).read())
    launcher = tmp_path / ".venv" / "bin" / "mpiexec"
    launcher.parent.mkdir(parents=True)
    launcher.write_text(_REAPING_HUNG_LAUNCHER)
    launcher.chmod(0o755)
    try:
        proc = subprocess.run(["bash", str(script), "1", "--", "sleep", "2"], capture_output=True, text=True,
                              timeout=60, env=run_env(SHARDREC_LAUNCHER_HANG_S="2"))
    finally:  # a script that did not kill it must not leave it to the next tests
        pid = int((launcher.parent / "launcher.pid").read_text())
        alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        if alive:
            psutil.Process(pid).kill()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"mpiexec (pid {pid}) still runs 2 s after every rank it started here ended" in proc.stderr, \
        proc.stderr[-3000:]
    assert not alive
