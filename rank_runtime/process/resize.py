"""How the supervisor asks a running job to stop for a resize (an elastic job growing onto hosts
that came back): SIGUSR2, which mpiexec forwards to every rank on every host.

A rank that got it says "no more data" in the next status round of the training key exchange, so
every rank ends its input at the same batch, as at the end of the data (key_pipeline.py), and the
end of training saves a checkpoint at that step (MonitoredTrainingSession's and the Estimator's
checkpoint hook do; a Session loop saves when its loop ends). The supervisor then starts the job
again on more ranks, from that checkpoint. Later passes over data end at once too: the request
stands until the process exits.
"""
import signal

from . import heartbeat
from ..formats.heartbeat_format import RESIZE_SIGNAL
from .logs import get_logger
from .state import STATE

log = get_logger("shardrec.resize")
SIGNAL = RESIZE_SIGNAL


def install() -> None:
    """From init(), under the supervisor only; a handler the script installed itself is kept (the
    job then cannot grow in place: the supervisor grows it at its next restart)."""
    if signal.getsignal(SIGNAL) not in (signal.SIG_DFL, None):
        log.warning("the script handles SIGUSR2 itself: an elastic job cannot ask it to stop for a resize")
        return
    signal.signal(SIGNAL, _handle)


def _handle(signum, frame):
    STATE.resize.asked = True


def requested() -> bool:
    return STATE.resize.asked


def stop(batches: int) -> None:
    """The training input ended after `batches` for the resize: said once in the log, and in every
    beat from here on (the supervisor restarts the job only when the ranks confirm the stop)."""
    if STATE.resize.stopped_after is None:
        STATE.resize.stopped_after = batches
        log.info("the supervisor asked the job to stop for a resize: the training input ends here, after %d "
                 "batch(es) of this pass, on every rank; the job resumes on its new ranks from the checkpoint "
                 "saved at the end of training", batches)
    heartbeat.resize_stop()
