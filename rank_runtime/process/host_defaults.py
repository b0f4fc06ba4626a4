"""Environment defaults set by the World before the libraries that read them start: MPI's waits,
Horovod's cycle and stall limits, and for ranks that share a host TensorFlow's thread pools; and
the C allocator told to keep freed memory."""
import ctypes
import os
import resource
import sys

from .logs import get_logger

log = get_logger("shardrec.host")


# Open MPI polls its transports at full speed while a blocking call (Horovod's allreduce, its
# negotiation every cycle) or a test in a loop (the key and row exchanges) waits. A rank whose
# threads share its cores (the step, the key pipeline, the exchanges, Horovod's cycle) then loses
# the core to a wait that has nothing to do: measured in bench/scaling.py, 2 ranks with a core
# each went from 0.34-0.49 of twice one rank to 0.94-1.02 with this alone. With it, a wait with
# nothing to receive yields its core to the rank's other threads (and polls again when none is
# runnable, so an idle core still answers at once).
YIELD_WHEN_IDLE = "OMPI_MCA_mpi_yield_when_idle"


def before_mpi() -> None:
    """Called by the World just before MPI starts. A script that started MPI itself (importing
    mpi4py.MPI) before init() is too late for the default: it is told how to set it."""
    if YIELD_WHEN_IDLE in os.environ:
        return
    if "mpi4py.MPI" not in sys.modules:
        os.environ[YIELD_WHEN_IDLE] = "1"
        return
    log.warning("MPI started before init() (mpi4py.MPI was imported first), so its waits spin at full speed and "
                "take the cores that this rank's step needs; set %s=1 in the environment of the job (the "
                "launchers in launch/ do), or call init() before importing mpi4py.MPI", YIELD_WHEN_IDLE)


def share_cores(size: int, local_size: int, exchange_timeout_s: float) -> None:
    """Defaults for a job of `size` ranks, `local_size` of them on this host. Horovod's cycle is
    shortened whenever there are several ranks: each step's dense allreduce waits for a cycle's
    negotiation (the demo, 2 ranks with a core each: 100k / 105k samples/s at 0.2 ms, 95k / 93k at
    1 ms, 71k / 77k at 5 ms; two namespace hosts went from 0.57 to 0.96 of one host's speed with it).
    TensorFlow sizes its thread pools for every core of the machine, and ranks that share a host
    and do so fight over the cores (measured in bench/: 2 ranks on 2 cores went from 3.4M to 4.6M
    ids/s). Horovod stops a collective that some rank never joins after the key exchange's timeout,
    as the exchange does. Values the user set are kept; TensorFlow reads these when its first
    session starts, so init() must come before it."""
    limit = int(max(1, exchange_timeout_s))
    # Horovod looks for stalled collectives every STALL_CHECK seconds (a warning naming the
    # missing ranks) and ends the job once one has stalled STALL_SHUTDOWN seconds.
    defaults = {"HOROVOD_STALL_CHECK_TIME_SECONDS": str(min(60, limit)), "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(limit)}
    if size > 1:
        defaults["HOROVOD_CYCLE_TIME"] = "0.2"
    if local_size > 1:
        import psutil

        mine, host = len(psutil.Process().cpu_affinity()), psutil.cpu_count() or 1
        # A rank bound to some of the host's cores (mpiexec --bind-to core, --map-by ...:PE=n) owns
        # them; an unbound rank shares all of them with the host's other ranks.
        per_rank = str(mine if mine < host else max(1, host // local_size))
        defaults.update(TF_NUM_INTRAOP_THREADS=per_rank, TF_NUM_INTEROP_THREADS=per_rank)
        log.info("%d ranks share this host's %d cores; this rank may use %d of them, %s threads per TensorFlow "
                 "pool", local_size, host, mine, per_rank)
    applied = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(applied)
    if applied:
        log.info("defaults applied: %s", " ".join(f"{k}={v}" for k, v in applied.items()))


KEEP_FREED_MEMORY = "SHARDREC_KEEP_FREED_MEMORY"
# mallopt's parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def keep_freed_memory() -> None:
    """glibc serves an allocation above its mmap threshold (32 MB at most) with a mapping of its own
    and unmaps it when freed, and gives the heap's free top back to the kernel. A step's large
    tensors (at dim 128 the restore gather's 54 MB, the loss's gradient as large) then come back
    every step as new pages that the kernel faults in and zeroes: 27k page faults and a third of a
    rank's CPU time a step (bench/sparse_step.py --dim 128: 1070 -> 710 ns per id with the
    memory kept; dim 16 unchanged). Served from the heap and never trimmed, they are reused. The
    price: the rank's resident memory stays at its highest, a one-off peak (a restore) included. Off with
    SHARDREC_KEEP_FREED_MEMORY=0, when GLIBC_TUNABLES sets malloc's own tunables, or under a
    limit on the process's memory (RLIMIT_DATA, RLIMIT_AS)."""
    if os.environ.get(KEEP_FREED_MEMORY, "1") == "0" or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return
    # Under a limit on the process's memory, kept memory and the heap's top pad count against it
    # (an SSD-tiered table trained under RLIMIT_DATA ran out with them): the limit wins.
    limited = [name for name in ("RLIMIT_DATA", "RLIMIT_AS")
               if resource.getrlimit(getattr(resource, name))[0] != resource.RLIM_INFINITY]
    if limited:
        log.info("%s is set: freed memory goes back to the system (%s=0 is implied)", limited[0], KEEP_FREED_MEMORY)
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        log.info("no mallopt in this C library: freed memory goes back to the system as it decides")
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) and mallopt(_M_TOP_PAD, 256 << 20)):
        log.warning("mallopt refused to keep freed memory; large tensors are faulted in afresh every step")
