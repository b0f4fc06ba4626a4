"""The rank layout and the communicators: MPI through mpi4py, Horovod on the same world, and a
duplicated communicator per key-exchange channel so the native all-to-alls never meet Horovod's
collectives or each other."""
import os
import sys
import time
import traceback

import numpy as np
import shardrec_native
from mpi4py import MPI

from .logs import get_logger, set_rank

log = get_logger("shardrec.world")
CHANNELS = ("train", "eval")


class World:
    def __init__(self):
        comm = MPI.COMM_WORLD
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        set_rank(self.rank, self.size)
        node.Free()
        _share_cores(self.local_size)
        import horovod.tensorflow as hvd

        if not hvd.is_initialized():
            hvd.init(comm=comm)
        if (hvd.rank(), hvd.size()) != (self.rank, self.size):
            raise RuntimeError(f"Horovod sees rank {hvd.rank()}/{hvd.size()}, MPI {self.rank}/{self.size}: "
                               "initialise Horovod on MPI.COMM_WORLD (or let init() do it)")
        # Each exchange lives on a communicator of its own; creating them is collective, and
        # every rank runs init() at the same point of the same script.
        self._comms = {name: comm.Dup() for name in CHANNELS}
        self.exchanges = {name: shardrec_native.KeyExchange(self._comms[name], name, name == "train")
                          for name in CHANNELS}
        self._helper = comm.Dup()
        self._helper_broken = None
        if self.size > 1:
            _abort_on_uncaught_exception(comm)

    def sum_over_ranks(self, value, what, timeout=60.0):
        """Sum of an int over all ranks. Every rank must call it at the same point; a lone caller
        gets an error after `timeout` seconds instead of hanging the job."""
        recv = np.zeros(1, np.int64)
        self._wait(lambda: self._helper.Iallreduce(np.array([value], np.int64), recv, op=MPI.SUM), what, timeout)
        return int(recv[0])

    def gather_from_ranks(self, value, what, timeout=60.0):
        """Every rank's int (a list indexed by rank); called by all ranks together, as sum_over_ranks."""
        recv = np.zeros(self.size, np.int64)
        self._wait(lambda: self._helper.Iallgather(np.array([value], np.int64), recv), what, timeout)
        return recv.tolist()

    def _wait(self, start, what, timeout):
        if self._helper_broken:
            raise RuntimeError(f"{what}: {self._helper_broken}")
        request = start()
        deadline = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                self._helper_broken = (f"not every rank called it within {timeout:.0f} s on an earlier call; "
                                       "all ranks must call it together, and the ranks are now out of step")
                raise TimeoutError(f"{what}: not every rank called it within {timeout:.0f} s; all ranks must "
                                   "call it together (at the same point of the script)")
            time.sleep(0.001)


def _share_cores(local_size):
    """Defaults for ranks that share a host: TensorFlow sizes its thread pools for every core of
    the machine, and N ranks doing so fight over the cores (measured in bench/: 2 ranks on 2 cores
    went from 3.4M to 4.6M ids/s). Horovod's negotiation cycle is shortened for the same reason:
    each step waits on two row all-to-alls. Values the user set are kept; TensorFlow reads these
    when its first session starts, so init() must come before it."""
    if local_size <= 1:
        return
    import psutil

    cores = len(psutil.Process().cpu_affinity())
    per_rank = str(max(1, cores // local_size))
    defaults = {"TF_NUM_INTRAOP_THREADS": per_rank, "TF_NUM_INTEROP_THREADS": per_rank, "HOROVOD_CYCLE_TIME": "0.2"}
    applied = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(applied)
    if applied:
        log.info("%d ranks share this host's %d cores: %s", local_size, cores,
                 " ".join(f"{k}={v}" for k, v in applied.items()))


def _abort_on_uncaught_exception(comm):
    """An uncaught error on one rank ends the whole job at once: the other ranks would otherwise
    wait in their next collective for ever."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        rank = comm.Get_rank()
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(f"[rank {rank}/{comm.Get_size()}] uncaught error, aborting the job:\n{text}")
        sys.stderr.flush()
        if issubclass(exc_type, KeyboardInterrupt):
            previous(exc_type, exc, tb)
        comm.Abort(1)

    sys.excepthook = hook


_world = None


def get_world():
    """The world, created on first use (collective: every rank calls it at the same point)."""
    global _world
    if _world is None:
        _world = World()
    return _world
