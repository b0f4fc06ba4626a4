"""How a running job is asked to finish its step, save and stop: by the supervisor for a resize (an
elastic job growing onto hosts that came back) or for the end of the job (shardrec-run got SIGTERM
or SIGINT), with SIGUSR2, which mpiexec forwards to every rank on every host; and, in a job that
trains from a stream (stream/), by SIGTERM sent to the ranks themselves (mpiexec's own SIGTERM kills
its ranks half a second after it forwards it, which is no time to save: stop a plain mpiexec job
with SIGUSR2, or send SIGTERM to its ranks).

A rank that got it says "no more data" in the next status round of the training key exchange, so
every rank ends its input at the same batch, as at the end of the data (key_pipeline.py), and the
end of training saves a checkpoint at that step (MonitoredTrainingSession's and the Estimator's
checkpoint hook do; a Session loop saves when its loop ends). The supervisor then starts the job
again on more ranks, from that checkpoint. Later passes over data end at once too: the request
stands until the process exits.

Python runs a signal's handler on the main thread, between two bytecodes; a main thread inside
Session.run waiting for a batch that a stream has not got yet would never run it. So the signals
also reach a pipe (signal.set_wakeup_fd, written by the interpreter's C-level handler on arrival),
which requested() reads from whichever thread asks: the key pipeline per batch, a stream's reader
while it waits.
"""
import os
import signal

from dataclasses import dataclass
from typing import Optional

from . import batch_events, heartbeat
from ..formats.heartbeat_format import RESIZE_SIGNAL
from .logs import get_logger

log = get_logger("shardrec.resize")
SIGNAL = RESIZE_SIGNAL


@dataclass
class ResizeState:
    """The supervisor asked for a stop (set by the signal handler, which may only set a field), and
    the batch after which this rank's input stopped for it (said once)."""
    asked: bool = False
    stopped_after: Optional[int] = None
    wakeup: Optional[int] = None  # the read end of the signals' pipe
    on_sigterm: bool = False  # SIGTERM asks for the stop too (a job that trains from a stream)
    terms: int = 0  # SIGTERMs arrived: the second ends the process


_STATE = ResizeState()


def install() -> None:
    """From init(), under the supervisor only; a handler the script installed itself is kept (the
    job then cannot grow in place: the supervisor grows it at its next restart)."""
    if signal.getsignal(SIGNAL) not in (signal.SIG_DFL, None):
        log.warning("the script handles SIGUSR2 itself: an elastic job cannot ask it to stop for a resize")
        return
    signal.signal(SIGNAL, _handle)
    _signals_to_pipe()


def _signals_to_pipe() -> None:
    if _STATE.wakeup is not None:
        return
    read, write = os.pipe()
    os.set_blocking(read, False)
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: the handlers alone (between steps)
        previous = None
    if previous is None or previous != -1:  # off the main thread, or another library's pipe: theirs stays
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return
    _STATE.wakeup = read


def _handle(signum, frame):
    _STATE.asked = True


def stop_on_sigterm() -> None:
    """A job that trains from a stream runs until it is stopped: the first SIGTERM ends the training
    input at the same batch on every rank (the script then saves and exits 0), a second one ends
    the process at once. Kept if the script handles SIGTERM itself; only from the main thread."""
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return
    try:
        signal.signal(signal.SIGTERM, _terminate)
    except ValueError:  # not the main thread
        log.warning("the stream was built off the main thread: SIGTERM ends the job at once, without a save")
        return
    _STATE.on_sigterm = True
    _signals_to_pipe()


def _terminate(signum, frame):
    if _STATE.wakeup is not None:
        requested()  # the pipe counts this SIGTERM
        return
    _STATE.terms += 1
    if _STATE.terms > 1:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    _STATE.asked = True


def requested() -> bool:
    state = _STATE
    if state.wakeup is not None:
        try:
            arrived = os.read(state.wakeup, 4096)
        except BlockingIOError:
            arrived = b""
        if state.on_sigterm:
            state.terms += arrived.count(bytes([signal.SIGTERM]))
        if state.terms > 1:  # the second SIGTERM: at once, from this thread (the main one may be stuck)
            log.warning("a second SIGTERM: the process ends now, without a save")
            os._exit(128 + signal.SIGTERM)
        if state.terms or bytes([SIGNAL]) in arrived:
            state.asked = True
    return state.asked


@dataclass(frozen=True)
class _StopSaid(batch_events.Observer):
    """A pass that ended because the job was asked to stop: said once (batch_events.py)."""

    def pass_ended(self, event: batch_events.PassEnded) -> None:
        if event.for_stop:
            stop(event.batches)


def observe_stops() -> None:
    """init(): the key pipeline's passes that end for a stop are said (and beaten) by stop()."""
    batch_events.register(_StopSaid())


def stop(batches: int) -> None:
    """The training input ended after `batches` for the resize: said once in the log, and in every
    beat from here on (the supervisor restarts the job only when the ranks confirm the stop)."""
    if _STATE.stopped_after is None:
        _STATE.stopped_after = batches
        log.info("the job was asked to stop (by a signal: the supervisor's resize or stop, or SIGTERM): the "
                 "training input ends here, after %d batch(es) of this pass, on every rank; the end of training "
                 "saves a checkpoint, which a restart resumes from", batches)
    heartbeat.resize_stop()
