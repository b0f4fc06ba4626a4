"""Heartbeats for the supervisor (orchestrator/supervisor.py): what a rank tells it, with no network
service and no shared filesystem of its own.

Active only when the supervisor started the rank (it sets SHARDREC_RUN_DIR): each rank then writes
one-line beats (heartbeat_format.py's Heartbeat, after `SHARDREC-HEARTBEAT `) to its standard error, which mpiexec forwards to the
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
import dataclasses
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Optional, Protocol

from ..formats.channel import Channel
from ..formats.heartbeat_format import ATTEMPT_ENV, INTERVAL_ENV, RESUME_ENV, RUN_DIR_ENV, STACKS_SIGNAL, Heartbeat
from . import batch_events

MIN_INTERVAL_S = 0.5


class WatchedTable(Protocol):
    """What a beat reads of a table (embedding/table.py's EmbeddingTable)."""

    def size(self) -> int: ...

    def beat_figures(self) -> "tuple[Optional[dict], Optional[dict]]":
        """Its admission and SSD tier counters (each None when the table has none)."""


@dataclass
class HeartbeatState:
    """The next beat (made by start()), when the last was written, the tables watched."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    beat: Optional[Heartbeat] = None
    written: float = 0.0
    exited: bool = False  # the last beat (exiting) is written: no beat may follow it
    fd: Optional[int] = None
    tables: Dict[str, WatchedTable] = field(default_factory=dict)
    # What the last progress beat read of the tables (the ticker repeats it).
    sizes: Dict[str, int] = field(default_factory=dict)
    admission: Dict[str, dict] = field(default_factory=dict)
    tiers: Dict[str, dict] = field(default_factory=dict)


_STATE = HeartbeatState()


@dataclasses.dataclass(frozen=True)
class _BatchBeats(batch_events.Observer):
    """The key pipeline's batches, counted in the beats (batch_events.py)."""

    def batch_exchanged(self, event: batch_events.BatchExchanged) -> None:
        batches_exchanged(event.channel, event.number)


def start(rank: int, size: int) -> None:
    """Called by init(): from here on this rank's progress goes to the supervisor."""
    if not os.environ.get(RUN_DIR_ENV):
        return
    batch_events.register(_BatchBeats())
    if _STATE.fd is not None:
        return
    # A duplicate of the stderr mpiexec gave us: the script redirecting sys.stderr (or fd 2) later
    # must not swallow the beats.
    _STATE.fd = os.dup(2)
    import psutil

    # The rank's host, not the supervisor's: memory warnings compare against this.
    _STATE.beat = Heartbeat(rank=rank, size=size, pid=os.getpid(), host=socket.gethostname(),
                            host_memory=psutil.virtual_memory().total, attempt=int(os.environ.get(ATTEMPT_ENV, "0")))
    atexit.register(_last_beat)
    _write(force=True)
    interval = float(os.environ.get(INTERVAL_ENV, "5"))
    threading.Thread(target=_tick, args=(interval,), name="shardrec-heartbeat", daemon=True).start()


def stacks_on_sigusr1() -> None:
    """From init() on, SIGUSR1 makes the rank write every thread's stack to its stderr (and go on):
    the supervisor sends it to a rank it is about to kill as hung, a user or a test to any rank
    that seems stuck. A handler the script installed itself is kept."""
    if signal.getsignal(STACKS_SIGNAL) in (signal.SIG_DFL, None):
        # Ignored underneath: faulthandler puts back the handler it found when Python finalises, and
        # the signal's default action would end a rank that is still in MPI's finalize then.
        signal.signal(STACKS_SIGNAL, signal.SIG_IGN)
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)


def active() -> bool:
    """Whether a supervisor reads this rank's heartbeats (callers skip their work otherwise)."""
    return _STATE.fd is not None


def watch_tables(tables: Dict[str, WatchedTable]) -> None:
    """Tables (name -> table) whose key counts go into every beat; they are read only
    when a beat is written, not on every progress."""
    _STATE.tables.update(tables)


def _progress(**fields) -> None:
    """One unit of progress, with what the rank knows of it (Heartbeat fields)."""
    if _STATE.fd is None:
        return
    with _STATE.lock:
        assert _STATE.beat is not None  # start() made it, with the fd
        _STATE.beat = dataclasses.replace(_STATE.beat, progress=_STATE.beat.progress + 1, **fields)
    _write()


def batches_exchanged(channel: Channel, batches: int) -> None:
    """The key pipeline exchanged its `batches`-th batch of this pass on `channel`."""
    if channel == Channel.TRAIN:
        _progress(train_batches=int(batches))
    else:
        _progress(eval_batches=int(batches))


def resize_stop() -> None:
    """This rank ended its training input because the supervisor asked it to (resize.py)."""
    _progress(resize_stop=True)


def waiting_for_data(waiting: bool) -> None:
    """This rank's stream has nothing new and it waits (True), or it has data again (False)."""
    if _STATE.fd is None:
        return
    with _STATE.lock:
        assert _STATE.beat is not None
        _STATE.beat = dataclasses.replace(_STATE.beat, waiting_for_data=waiting)
    _write(force=True, tick=True)  # the reader's thread: the tables are read on the key pipeline's only


def report(step: Optional[int] = None, loss: Optional[float] = None, samples_per_s: Optional[float] = None,
           total_steps: Optional[int] = None) -> None:
    """What a training script tells the supervisor after a step: its global step, loss, speed and
    (if known) the number of steps, for the progress line and the ETA. A no-op without one."""
    given = {"step": step, "total_steps": total_steps}
    fields: Dict[str, float] = {k: int(v) for k, v in given.items() if v is not None}
    fields.update({k: float(v) for k, v in (("loss", loss), ("samples_per_s", samples_per_s)) if v is not None})
    _progress(**fields)


def resume_checkpoint() -> Optional[str]:
    """The checkpoint the supervisor asks this attempt to resume from (the last committed one when
    the job was restarted), or None. Estimator and MonitoredTrainingSession jobs resume from their
    model directory by themselves; Session-mode scripts restore this path."""
    return os.environ.get(RESUME_ENV) or None


def _tick(interval):
    while True:
        time.sleep(interval)
        _write(force=True, tick=True)


def _read_tables():
    """Keys held, admission and tier counters of the watched tables, for the next beats."""
    sizes, admission, tiers = {}, {}, {}
    for name, table in _STATE.tables.items():
        sizes[name] = table.size()
        counted, tiered = table.beat_figures()
        if counted is not None:
            admission[name] = counted
        if tiered is not None:
            tiers[name] = tiered
    _STATE.sizes, _STATE.admission, _STATE.tiers = sizes, admission, tiers


def _write(force=False, tick=False, exiting=False):
    now = time.time()
    with _STATE.lock:
        if _STATE.exited or (not force and now - _STATE.written < MIN_INTERVAL_S):
            return
        _STATE.written = now
    if _STATE.tables and not tick:
        # Read on the thread that makes progress, never from the ticker while a batch grows a table.
        _read_tables()
    # Made and written under the lock: a beat another thread began (the ticker's) could otherwise
    # land after the last one and tell the supervisor that a rank which finished never did.
    with _STATE.lock:
        if _STATE.exited:
            return
        _STATE.exited = exiting
        beat = dataclasses.replace(_STATE.beat, time=time.time(), exiting=exiting)
        beat.tables, beat.admission, beat.tiers = dict(_STATE.sizes), dict(_STATE.admission), dict(_STATE.tiers)
        try:
            import psutil

            beat.rss = psutil.Process().memory_info().rss
        except Exception:  # noqa: BLE001 - a heartbeat must never fail the step
            pass
        # One write of one line, well under PIPE_BUF: no other writer's bytes land inside it (a line of
        # the script's left unfinished is split around it by the supervisor).
        try:
            os.write(_STATE.fd, beat.line())
        except OSError:
            pass  # mpiexec gone: the supervisor already knows


def _last_beat():
    if _STATE.fd is not None:
        _write(force=True, exiting=True)
