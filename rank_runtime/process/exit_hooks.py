"""A rank that fails ends the whole MPI job at once, naming itself, instead of leaving its peers
waiting in their next collective.

Installed when ``shardrec.rank_runtime`` (or ``mx_rec``) is imported, the one thing an import
does to the process: a script often starts MPI itself (``from mpi4py import MPI`` to read its rank
and pick its data) and fails before it calls init(), on a wrong path on one host, say. Its peer is
then inside init()'s first collective, and the failing rank's own exit hangs too, because MPI_Finalize
waits for every rank. The hooks act only in a job of more than one rank, so a script without
mpiexec, or one rank alone, exits as Python always does.

- An uncaught error: a line naming the rank and the error, then MPI_Abort(1). From init() on
  (World), sys.excepthook does it at once, before any other exit handler runs (Horovod's shutdown,
  the key exchange's leave, which would tell the peers another story first). Before init() it is
  found at exit (sys.last_value, after Python's traceback), so that an import leaves
  sys.excepthook the user's.
- ``sys.exit`` with a failing status: a line naming the rank and the status, then MPI_Abort(status)
  (the status is recorded by a wrapper of sys.exit).
- Either one before MPI started, in a rank that mpiexec launched with others: the rank starts MPI
  at exit and aborts as above (_abort_through_mpi says why), rather than leave the ending to mpiexec.
Python's atexit handlers run before mpi4py finalises MPI, which it does at the C level.

A rank whose exit takes long says what it waits for, and the exit is bounded (the exit watch,
install_exit_watch(), from init()). Once the process begins to exit (threading's at-exit
callbacks, which run before Python joins the script's threads and before the atexit handlers:
terminate_config_initializer, leaving the key exchanges, the last heartbeat, Horovod's shutdown),
a watcher thread looks at the main thread. After EXIT_SAY_S it logs where the main thread is (its
innermost frames) and which other threads still run, again every EXIT_SAY_AGAIN_S; after
SHARDREC_EXIT_TIMEOUT_S (default EXIT_TIMEOUT_S) it writes every thread's stack to stderr and ends
the job with an error naming the rank and the wait (MPI_Abort where MPI runs with several ranks,
else exit status 1): a rank that finished its work never holds its peers, or the supervisor, for
ever. MPI's own finalize (after the Python handlers) is out of its reach: Python's threads stop
before it.
"""
import atexit
import faulthandler
import gc
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import List

from .host_defaults import YIELD_WHEN_IDLE
from .logs import get_logger


@dataclass
class ExitState:
    """The statuses sys.exit was called with; whether the hooks are installed (once per process)."""
    statuses: List[object] = field(default_factory=list)
    installed: bool = False


_STATE = ExitState()


def exit_failed() -> bool:
    """Whether this process is exiting with a failure: sys.exit with a failing status, or an
    uncaught error."""
    return _failing_status() is not None or getattr(sys, "last_value", None) is not None


def _failing_status():
    """The status of a failing sys.exit (a non-zero number, or a message), else None."""
    statuses = _STATE.statuses
    return statuses[-1] if statuses and statuses[-1] not in (None, 0) else None


def _mpi_running():
    """Whether MPI runs in this process. Never starts it: only a module someone imported is asked."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()


def _mpi_started():
    """Whether MPI was started in this process (running or finalised since)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized()


def _running_world():
    """(rank, size, COMM_WORLD) while MPI runs here with more than one rank, else None."""
    if not _mpi_running():
        return None
    comm = sys.modules["mpi4py.MPI"].COMM_WORLD
    return (comm.Get_rank(), comm.Get_size(), comm) if comm.Get_size() > 1 else None


def _launcher_world():
    """(rank, size) that mpiexec gave this process (its environment) when it launched several,
    for a rank that fails before MPI runs; else None."""
    rank, size = os.environ.get("OMPI_COMM_WORLD_RANK"), os.environ.get("OMPI_COMM_WORLD_SIZE")
    if rank is None or size is None or not size.isdigit() or int(size) < 2:
        return None
    return rank, size


def _abort_through_mpi(rank: str, size: str, code: int, what: str) -> None:
    """Starts MPI and calls MPI_Abort(code), so that the job ends the way a failure after MPI's start
    ends it. Simply exiting leaves the ending to mpiexec, and Open MPI 5.0's launcher (its PMIx
    server) can deadlock for ever, its children left unreaped and SIGTERM ignored, when a peer is
    connecting to it in MPI's start at the moment it terminates the job (a peer that fails while
    the others import TensorFlow: seen once in a CI run and once in 51 runs of that job). MPI's
    start returns only once every rank has started it, so no peer is connecting when the abort
    comes. A peer that never starts MPI (busy before init(), or a script without MPI) would hold
    this rank there: after SHARDREC_EXIT_TIMEOUT_S, the bound of every exit, it exits (status 1)
    and leaves the ending to mpiexec."""
    prefix = f"[rank {rank}/{size}] "
    try:
        wait = exit_timeout_s()
    except ValueError:
        wait = EXIT_TIMEOUT_S
    _say(f"{prefix}{what} before MPI started; starting MPI to end the whole job once every rank has started it "
         f"(MPI_Abort, status {code}; after {wait:g} s, {EXIT_TIMEOUT_ENV}, this rank writes its stack and exits with "
         "status 1, and mpiexec ends the job)\n")
    # The wait in MPI's start would otherwise spin on a core that the peers' start-up needs.
    os.environ.setdefault(YIELD_WHEN_IDLE, "1")
    # MPI's start holds the GIL, so no Python thread could bound it: faulthandler's watchdog is C.
    faulthandler.dump_traceback_later(wait, exit=True)
    try:
        from mpi4py import MPI
    except Exception as e:  # noqa: BLE001 - any failure here leaves the exit as it was
        faulthandler.cancel_dump_traceback_later()
        _say(f"{prefix}could not start MPI to end the job ({type(e).__name__}: {e}); exiting, mpiexec ends the job\n")
        return
    MPI.COMM_WORLD.Abort(code)


def _say(text):
    sys.stderr.write(text)
    sys.stderr.flush()


def install() -> None:
    """Idempotent: wraps sys.exit and registers the at-exit check (sys.excepthook stays the user's)."""
    if _STATE.installed:
        return
    _STATE.installed = True
    # Registered first, so it runs after every later handler: Python's finalisation then runs no
    # cyclic collection over the objects alive at that point, which for a process that imported
    # TensorFlow costs 0.5-0.9 s of CPU, a sixth of a short rank's. Objects freed by their reference
    # counts (files, sockets) are still closed; a cycle left at exit is not finalised, as Python
    # does not promise anyway.
    atexit.register(gc.freeze)
    previous_exit = sys.exit

    def exit(status=None):  # noqa: A001 - it is sys.exit
        _STATE.statuses.append(status)
        previous_exit(status)

    def at_exit():
        # Python has printed an uncaught error's traceback (and set sys.last_value) by now.
        uncaught = getattr(sys, "last_value", None)
        world = _running_world()
        status = _failing_status()
        if world is None:
            launched = _launcher_world()
            if launched is None or _mpi_started() or (status is None and uncaught is None):
                return
            if status is not None:
                _abort_through_mpi(*launched, status if isinstance(status, int) else 1, f"exiting with status {status!r}")
            else:
                _abort_through_mpi(*launched, 1, f"uncaught error ({type(uncaught).__name__}: {uncaught})")
            return
        rank, size, comm = world
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

    excepthook._shardrec = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook

EXIT_SAY_S = 5.0
EXIT_SAY_AGAIN_S = 15.0
EXIT_TIMEOUT_S = 120.0
EXIT_TIMEOUT_ENV = "SHARDREC_EXIT_TIMEOUT_S"

log = get_logger("shardrec.exit")


def exit_timeout_s() -> float:
    text = os.environ.get(EXIT_TIMEOUT_ENV, "")
    try:
        value = float(text) if text else EXIT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{EXIT_TIMEOUT_ENV}={text!r} is not a number of seconds; give one > 0, or leave it "
                         f"unset for {EXIT_TIMEOUT_S:g} s") from None
    if value <= 0:
        raise ValueError(f"{EXIT_TIMEOUT_ENV}={text!r}: give a number of seconds > 0, or leave it unset for "
                         f"{EXIT_TIMEOUT_S:g} s")
    return value


def where_main_waits() -> str:
    """The main thread's innermost frames, innermost first: what it waits in."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return "the main thread has left Python (MPI's or the interpreter's own shutdown)"
    stack = traceback.extract_stack(frame)
    if stack[-1].name == "_shutdown" and stack[-1].filename == threading.__file__:
        return "Python's join of the script's own threads (threads not made daemon=True)"
    return " <- ".join(f"{f.name} ({f.filename}:{f.lineno})" for f in reversed(stack[-3:]))


def _others() -> str:
    names = [t.name for t in threading.enumerate() if t is not threading.current_thread()
             and t is not threading.main_thread()]
    return ", ".join(names) if names else "none"


def _end(waited: float, where: str) -> None:
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    message = (f"exiting took {waited:.0f} s ({EXIT_TIMEOUT_ENV}), waiting in {where}; other threads: {_others()}; "
               "every thread's stack is above")
    world = _running_world()
    if world is not None:
        rank, size, comm = world
        _say(f"[rank {rank}/{size}] {message}; ending the whole job (MPI_Abort, status 1)\n")
        comm.Abort(1)
    _say(f"{message}; ending the process (exit status 1)\n")
    os._exit(1)


def _start_exit_watch() -> None:
    """Starts the watcher (threading calls it as the interpreter begins to exit)."""
    limit = exit_timeout_s()
    began = time.monotonic()

    def watch():
        say_at = EXIT_SAY_S
        while True:
            time.sleep(0.25)
            waited = time.monotonic() - began
            if waited >= limit:
                _end(waited, where_main_waits())
            if waited >= say_at:
                log.warning("exiting for %.0f s now; the main thread waits in %s; other threads: %s (the exit ends "
                            "the process after %s s, %s)", waited, where_main_waits(), _others(), f"{limit:g}",
                            EXIT_TIMEOUT_ENV)
                say_at += EXIT_SAY_AGAIN_S

    threading.Thread(target=watch, name="shardrec-exit-watch", daemon=True).start()


def install_exit_watch() -> None:
    """Called by init(): the watcher starts when the process begins to exit. Checks the timeout's
    setting now, so that a bad one is said at init, not at exit."""
    exit_timeout_s()
    register = getattr(threading, "_register_atexit", None)  # CPython 3.9+: before the script's threads are joined
    try:
        if register is None:
            raise RuntimeError
        register(_start_exit_watch)
    except RuntimeError:  # no such hook, or the interpreter already exits
        atexit.register(_start_exit_watch)
