"""Heartbeats for the supervisor (orchestrator/supervisor.py): what a rank tells it, with no network
service and no shared filesystem of its own.

Active only when the supervisor started the rank (it sets SHARDREC_RUN_DIR): each rank then writes
one-line beats (`SHARDREC-HEARTBEAT {json}`) to its standard error, which mpiexec forwards to the
supervisor over the same links as the rank's output. That path is the point: a rank on a host whose
link is cut falls silent for the supervisor exactly as the host does, while the ranks it leaves
stuck in a collective keep ticking.

Two kinds of beat, both carrying the progress counter:
- on progress (the key pipeline finished a batch, or the script called report()), at most twice a
  second: a rank that hangs stops making progress, which is how a hung rank is told from a slow one;
- a tick every SHARDREC_HEARTBEAT_INTERVAL_S seconds from a daemon thread: a rank (or host) that
  ticks no more is frozen, dead or cut off, not merely waiting.
The last beat, at exit, says so. SIGUSR1 makes the rank write every thread's stack to its log.
"""
import atexit
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time

RUN_DIR_ENV = "SHARDREC_RUN_DIR"
ATTEMPT_ENV = "SHARDREC_ATTEMPT"
RESUME_ENV = "SHARDREC_RESUME_FROM"
INTERVAL_ENV = "SHARDREC_HEARTBEAT_INTERVAL_S"
MARK = "SHARDREC-HEARTBEAT "
MIN_INTERVAL_S = 0.5

_lock = threading.Lock()
_state = {"fields": {}, "progress": 0, "written": 0.0, "fd": None, "tables": {}}


def start(rank, size):
    """Called by init(): from here on this rank's progress goes to the supervisor."""
    if not os.environ.get(RUN_DIR_ENV) or _state["fd"] is not None:
        return
    # A duplicate of the stderr mpiexec gave us: the script redirecting sys.stderr (or fd 2) later
    # must not swallow the beats.
    _state["fd"] = os.dup(2)
    import psutil

    # The rank's host, not the supervisor's: memory warnings compare against this.
    _state["fields"].update(rank=rank, size=size, pid=os.getpid(), host=socket.gethostname(),
                            host_memory=psutil.virtual_memory().total, attempt=int(os.environ.get(ATTEMPT_ENV, "0")))
    atexit.register(_last_beat)
    # The supervisor sends SIGUSR1 to a rank it is about to kill as hung: every thread's stack goes
    # to the rank's log, saying where it was stuck.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    _write(force=True)
    interval = float(os.environ.get(INTERVAL_ENV, "5"))
    threading.Thread(target=_tick, args=(interval,), name="shardrec-heartbeat", daemon=True).start()


def active():
    """Whether a supervisor reads this rank's heartbeats (callers skip their work otherwise)."""
    return _state["fd"] is not None


def watch_tables(tables):
    """Tables (name -> object with size()) whose key counts go into every beat; sizes are read only
    when a beat is written, not on every progress."""
    _state["tables"].update(tables)


def progress(**fields):
    """One unit of progress (a batch exchanged, a step reported), with what the rank knows of it."""
    if _state["fd"] is None:
        return
    with _lock:
        _state["progress"] += 1
        _state["fields"].update(fields)
    _write()


def report(step=None, loss=None, samples_per_s=None, total_steps=None):
    """What a training script tells the supervisor after a step: its global step, loss, speed and
    (if known) the number of steps, for the progress line and the ETA. A no-op without one."""
    fields = {k: v for k, v in (("step", step), ("loss", loss), ("samples_per_s", samples_per_s),
                                ("total_steps", total_steps)) if v is not None}
    progress(**{k: float(v) if k in ("loss", "samples_per_s") else int(v) for k, v in fields.items()})


def resume_checkpoint():
    """The checkpoint the supervisor asks this attempt to resume from (the last committed one when
    the job was restarted), or None. Estimator and MonitoredTrainingSession jobs resume from their
    model directory by themselves; Session-mode scripts restore this path."""
    return os.environ.get(RESUME_ENV) or None


def _tick(interval):
    while True:
        time.sleep(interval)
        _write(force=True, tick=True)


def _write(force=False, tick=False, **extra):
    now = time.time()
    with _lock:
        if not force and now - _state["written"] < MIN_INTERVAL_S:
            return
        _state["written"] = now
        beat = dict(_state["fields"], progress=_state["progress"], time=now, **extra)
    if _state["tables"] and not tick:
        # Read on the thread that makes progress, never from the ticker while a batch grows a table.
        _state["sizes"] = {name: table.size() for name, table in _state["tables"].items()}
        _state["admission"] = {name: table.admission_counters() for name, table in _state["tables"].items()
                               if table.thresholds is not None and table.thresholds.counts}
        _state["tiers"] = {name: table.ssd.counters(table.index) for name, table in _state["tables"].items()
                           if table.ssd is not None}
    if _state.get("sizes"):
        beat["tables"] = _state["sizes"]
    for kind in ("admission", "tiers"):
        if _state.get(kind):
            beat[kind] = _state[kind]
    try:
        import psutil

        beat["rss"] = psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001 - a heartbeat must never fail the step
        pass
    # One write of one line, well under PIPE_BUF: no other writer's bytes land inside it (a line of
    # the script's left unfinished is split around it by the supervisor).
    line = (MARK + json.dumps(beat, separators=(",", ":")) + "\n").encode()
    try:
        os.write(_state["fd"], line)
    except OSError:
        pass  # mpiexec gone: the supervisor already knows


def _last_beat():
    if _state["fd"] is not None:
        _write(force=True, exiting=True)
