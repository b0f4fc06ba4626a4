"""Environment defaults for ranks that share a host, set by the World before TensorFlow and
Horovod read them (their thread pools, Horovod's cycle and stall limits)."""
import os

from .logs import get_logger

log = get_logger("shardrec.host")


def share_cores(local_size: int, exchange_timeout_s: float) -> None:
    """Defaults for ranks that share a host. TensorFlow sizes its thread pools for every core of
    the machine, and N ranks doing so fight over the cores (measured in bench/: 2 ranks on 2 cores
    went from 3.4M to 4.6M ids/s); Horovod's negotiation cycle is shortened because each step waits
    on two row all-to-alls. Horovod stops a collective that some rank never joins after the key
    exchange's timeout, as the exchange does. Values the user set are kept; TensorFlow reads these
    when its first session starts, so init() must come before it."""
    limit = int(max(1, exchange_timeout_s))
    # Horovod looks for stalled collectives every STALL_CHECK seconds (a warning naming the
    # missing ranks) and ends the job once one has stalled STALL_SHUTDOWN seconds.
    defaults = {"HOROVOD_STALL_CHECK_TIME_SECONDS": str(min(60, limit)), "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(limit)}
    if local_size > 1:
        import psutil

        cores = len(psutil.Process().cpu_affinity())
        per_rank = str(max(1, cores // local_size))
        defaults.update(TF_NUM_INTRAOP_THREADS=per_rank, TF_NUM_INTEROP_THREADS=per_rank, HOROVOD_CYCLE_TIME="0.2")
        log.info("%d ranks share this host's %d cores", local_size, cores)
    applied = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(applied)
    if applied:
        log.info("defaults applied: %s", " ".join(f"{k}={v}" for k, v in applied.items()))
