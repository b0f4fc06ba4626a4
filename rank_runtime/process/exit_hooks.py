"""A rank that fails ends the whole MPI job at once, naming itself, instead of leaving its peers
waiting in their next collective.

Installed when ``shardrec.rank_runtime`` (or ``mx_rec``) is imported, the one thing an import
does to the process: a script often starts MPI itself (``from mpi4py import MPI`` to read its rank
and pick its data) and fails before it calls init(), on a wrong path on one host, say. Its peer is
then inside init()'s first collective, and the failing rank's own exit hangs too, because MPI_Finalize
waits for every rank. The hooks act only while MPI runs in this process with more than one rank,
so a script without MPI, or one rank alone, exits as Python always does.

- An uncaught error: a line naming the rank and the error, then MPI_Abort(1). From init() on
  (World), sys.excepthook does it at once, before any other exit handler runs (Horovod's shutdown,
  the key exchange's leave, which would tell the peers another story first). Before init() it is
  found at exit (sys.last_value, after Python's traceback), so that an import leaves
  sys.excepthook the user's.
- ``sys.exit`` with a failing status: a line naming the rank and the status, then MPI_Abort(status)
  (the status is recorded by a wrapper of sys.exit).
Python's atexit handlers run before mpi4py finalises MPI, which it does at the C level.
"""
import atexit
import os
import sys
import traceback

from .state import STATE


def exit_failed() -> bool:
    """Whether this process is exiting with a failure: sys.exit with a failing status, or an
    uncaught error."""
    return _failing_status() is not None or getattr(sys, "last_value", None) is not None


def _failing_status():
    """The status of a failing sys.exit (a non-zero number, or a message), else None."""
    statuses = STATE.exit_statuses
    return statuses[-1] if statuses and statuses[-1] not in (None, 0) else None


def _mpi_running():
    """Whether MPI runs in this process. Never starts it: only a module someone imported is asked."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def _running_world():
    """(rank, size, COMM_WORLD) while MPI runs here with more than one rank, else None."""
    if not _mpi_running():
        return None
    comm = sys.modules["mpi4py.MPI"].COMM_WORLD
    return (comm.Get_rank(), comm.Get_size(), comm) if comm.Get_size() > 1 else None


def _launcher_rank():
    """The rank mpiexec gave this process (its environment), for a rank that fails before MPI runs."""
    rank, size = os.environ.get("OMPI_COMM_WORLD_RANK"), os.environ.get("OMPI_COMM_WORLD_SIZE")
    return f"[rank {rank}/{size}] " if rank is not None and size is not None else ""


def _say(text):
    sys.stderr.write(text)
    sys.stderr.flush()


def install() -> None:
    """Idempotent: wraps sys.exit and registers the at-exit check (sys.excepthook stays the user's)."""
    if STATE.exit_hooks_installed:
        return
    STATE.exit_hooks_installed = True
    previous_exit = sys.exit

    def exit(status=None):  # noqa: A001 - it is sys.exit
        STATE.exit_statuses.append(status)
        previous_exit(status)

    def at_exit():
        # Python has printed an uncaught error's traceback (and set sys.last_value) by now.
        uncaught = getattr(sys, "last_value", None)
        world = _running_world()
        if world is None:
            prefix = _launcher_rank()
            if prefix and uncaught is not None and not _mpi_running():
                _say(f"{prefix}uncaught error before MPI started (mpiexec ends the job when this rank exits)\n")
            return
        rank, size, comm = world
        status = _failing_status()
        if status is not None:
            code = status if isinstance(status, int) else 1
            _say(f"[rank {rank}/{size}] exiting with status {status!r}, ending the whole job (MPI_Abort, status {code})\n")
            comm.Abort(code)
        elif uncaught is not None:
            _say(f"[rank {rank}/{size}] uncaught error, ending the whole job (MPI_Abort, status 1): "
                 f"{type(uncaught).__name__}: {uncaught}\n")
            comm.Abort(1)

    sys.exit = exit
    atexit.register(at_exit)


def abort_on_uncaught_error() -> None:
    """From init() on: an uncaught error ends the job at once (idempotent), its traceback first."""
    if getattr(sys.excepthook, "_shardrec", False):
        return
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        world = _running_world()
        if world is None:
            previous(exc_type, exc, tb)
            return
        rank, size, comm = world
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        _say(f"[rank {rank}/{size}] uncaught error, ending the whole job (MPI_Abort, status 1):\n{text}")
        comm.Abort(1)

    excepthook._shardrec = True
    sys.excepthook = excepthook
