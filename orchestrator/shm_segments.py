"""Open MPI's shared-memory segments of a job that was killed.

Each rank of an Open MPI 5 job maps a file `/dev/shm/sm_segment.<host>.<uid>.<jobid>.<local rank>`
(the shared-memory transport's; Open MPI 4 named it `vader_segment`). mpiexec's daemon removes them
when the job ends, but a job whose mpiexec is killed (a supervisor stopping a hung attempt, a test, a
user's kill -9) leaves them behind, 16 MiB each, until the machine restarts. The job's identity is
the name without its last field: found in the maps of the job's live processes before they are
killed, it names every segment of the job, also those of its ranks that died first.
"""
import glob
import os

import psutil

SHM = "/dev/shm"
_KINDS = ("sm_segment.", "vader_segment.")


def job_prefixes(processes) -> set:
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


def remove(prefixes) -> list:
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


def left(prefixes) -> list:
    """The segment files of the jobs `prefixes` name that are still there."""
    return sorted(p for prefix in prefixes for p in glob.glob(glob.escape(prefix) + "*"))
