"""A rank whose exit takes long says what it waits for, and its exit is bounded.

Once a process that ran init() begins to exit (threading's at-exit callbacks, which run before
Python joins the script's threads and before the atexit handlers: terminate_config_initializer,
leaving the key exchanges, the last heartbeat, Horovod's shutdown), a watcher thread looks at the
main thread. After EXIT_SAY_S it logs where the main thread is (its innermost frames) and which
other threads still run, and again every EXIT_SAY_AGAIN_S; after SHARDREC_EXIT_TIMEOUT_S (default
EXIT_TIMEOUT_S) it writes every thread's stack to stderr and ends the job with an error naming
the rank and the wait (MPI_Abort where MPI runs with several ranks, else exit status 1): a rank that
finished its work never holds its peers, or the supervisor, for ever. MPI's own finalize (after
the Python handlers) is out of its reach: Python's threads stop before it.
"""
import faulthandler
import os
import sys
import threading
import time
import traceback

from .logs import get_logger

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
    frame = sys._current_frames().get(threading.main_thread().ident)
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
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1:
        rank, size = mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
        sys.stderr.write(f"[rank {rank}/{size}] {message}; ending the whole job (MPI_Abort, status 1)\n")
        sys.stderr.flush()
        mpi.COMM_WORLD.Abort(1)
    sys.stderr.write(f"{message}; ending the process (exit status 1)\n")
    sys.stderr.flush()
    os._exit(1)


def start() -> None:
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


def install() -> None:
    """Called by init(): the watcher starts when the process begins to exit. Checks the timeout's
    setting now, so that a bad one is said at init, not at exit."""
    exit_timeout_s()
    register = getattr(threading, "_register_atexit", None)  # CPython 3.9+: before the script's threads are joined
    try:
        if register is None:
            raise RuntimeError
        register(start)
    except RuntimeError:  # no such hook, or the interpreter already exits
        import atexit

        atexit.register(start)
