"""Killing an MPI job's processes without leaving anything behind, and asking them for their stacks.

Each rank of an Open MPI 5 job maps a file `/dev/shm/sm_segment.<host>.<uid>.<jobid>.<local rank>`
(the shared-memory transport's; Open MPI 4 named it `vader_segment`). mpiexec's daemon removes them
when the job ends, but a job whose mpiexec is killed (a supervisor stopping a hung attempt, a test, a
user's kill -9) leaves them behind, 16 MiB each, until the machine restarts. The job's identity is
the name without its last field: found in the maps of the job's live processes before they are
killed, it names every segment of the job, also those of its ranks that died first. kill_job()
does both; the supervisor, the tests' helpers and bench/startup_loop.py use it.
"""
import glob
import os
from typing import Iterable, List, Set, Tuple, Union

import psutil

from shardrec.rank_runtime.formats.heartbeat_format import STACKS_SIGNAL

SHM = "/dev/shm"
_KINDS = ("sm_segment.", "vader_segment.")


def job_prefixes(processes: Iterable[psutil.Process]) -> Set[str]:
    """The segment prefixes (`/dev/shm/sm_segment.<host>.<uid>.<jobid>.`) that `processes` (psutil
    Processes or pids) have mapped: the jobs they belong to."""
    found = set()
    for p in processes:
        pid = p.pid if isinstance(p, psutil.Process) else int(p)
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[-1]
                    name = os.path.basename(path)
                    if os.path.dirname(path) == SHM and name.startswith(_KINDS) and name.count(".") >= 4:
                        found.add(os.path.join(SHM, name.rsplit(".", 1)[0] + "."))
        except (OSError, ValueError):
            continue  # gone already, or not ours to read
    return found


def remove(prefixes: Iterable[str]) -> List[str]:
    """Removes every segment file of the jobs `prefixes` name; returns the paths removed."""
    removed = []
    for prefix in prefixes:
        for path in glob.glob(glob.escape(prefix) + "*"):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def segments_now() -> set:
    """Every Open MPI shared-memory segment in /dev/shm now (a test compares before and after)."""
    return {e for e in os.listdir(SHM) if e.startswith(_KINDS)}


def ask_for_stacks(processes: Iterable[psutil.Process]) -> List[psutil.Process]:
    """SIGUSR1 to each of `processes` (a rank's init() makes it write its threads' stacks);
    returns those asked."""
    asked = []
    for p in processes:
        try:
            p.send_signal(STACKS_SIGNAL)
            asked.append(p)
        except psutil.Error:
            pass
    return asked


def kill_job(processes: Iterable[Union[psutil.Process, int]],
             timeout: float = 15.0) -> Tuple[List[psutil.Process], List[str]]:
    """SIGKILLs `processes` (psutil Processes or pids), waits up to `timeout` seconds for them, and
    removes the shared-memory segments of their job. Returns (the processes still alive, not
    zombies; the segment files removed)."""
    found = [p if isinstance(p, psutil.Process) else _process(p) for p in processes]
    procs = [p for p in found if p is not None]
    segments = job_prefixes(procs)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    alive = [p for p in alive if _running(p)]
    return alive, remove(segments)


def _process(pid):
    try:
        return psutil.Process(int(pid))
    except (psutil.Error, ValueError):
        return None


def _running(p):
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
