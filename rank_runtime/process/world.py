"""The rank layout and the communicators: MPI through mpi4py, Horovod on the same world (dense
allreduce and broadcast), a duplicated communicator per key-exchange channel, and two per lookup
for its row exchange (rows, gradients), so that the native all-to-alls never meet Horovod's
collectives or each other.

MPI starts here, in init(), and not when a module is imported (importing mpi4py.MPI, or the
native module that links it, starts MPI). While MPI runs, an uncaught error or a non-zero exit
on any rank ends the whole job at once, naming the rank and its status (exit_hooks.py).
"""
import atexit
import faulthandler
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

import numpy as np
import psutil

from . import exit_hooks, heartbeat, host_defaults
from ..formats.channel import Channel, ExchangeNames, RowExchangeName, agreed_keys, check_matches_native
from ..formats.heartbeat_format import STACKS_SIGNAL
from .logs import get_logger, set_rank

log = get_logger("shardrec.world")
# Every round of the key exchange waits at most this long for the other ranks (seconds).
EXCHANGE_TIMEOUT_ENV = "SHARDREC_EXCHANGE_TIMEOUT_S"
DEFAULT_EXCHANGE_TIMEOUT_S = 600.0


def exchange_timeout_s() -> float:
    text = os.environ.get(EXCHANGE_TIMEOUT_ENV)
    if text is None:
        return DEFAULT_EXCHANGE_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{EXCHANGE_TIMEOUT_ENV}={text!r} is not allowed; allowed: a number of seconds > 0 "
                         f"(default {DEFAULT_EXCHANGE_TIMEOUT_S:.0f})")
    return value


class World:
    def __init__(self):
        timeout = exchange_timeout_s()
        host_defaults.before_mpi()
        from mpi4py import MPI

        from ...native import core as native_core

        comm = MPI.COMM_WORLD
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        if self.size == 1:
            unlink_own_segments()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        set_rank(self.rank, self.size)
        # Before the peers learn this pid: a SIGUSR1 from a peer whose wait timed out writes this
        # rank's stacks (the other ranks' side of that wait) instead of ending the process.
        heartbeat.stacks_on_sigusr1()
        # (rank, pid, start time) of the other ranks on this host, for those stacks; the start time
        # tells a pid taken again by another process once that rank ended.
        mine = (self.rank, os.getpid(), psutil.Process().create_time())
        self._local_ranks = [peer for peer in node.allgather(mine) if peer[0] != self.rank]
        node.Free()
        exit_hooks.abort_on_uncaught_error()
        host_defaults.share_cores(self.size, self.local_size, timeout)
        host_defaults.keep_freed_memory()
        import horovod.tensorflow as hvd

        if not hvd.is_initialized():
            hvd.init(comm=comm)
        if (hvd.rank(), hvd.size()) != (self.rank, self.size):
            raise RuntimeError(f"Horovod sees rank {hvd.rank()}/{hvd.size()}, MPI {self.rank}/{self.size}: "
                               "initialise Horovod on MPI.COMM_WORLD (or let init() do it)")
        check_matches_native(native_core.Channel)
        # Each exchange lives on a communicator of its own; creating them is collective, and
        # every rank runs init() at the same point of the same script.
        self._comms = {channel: comm.Dup() for channel in Channel}
        self.exchanges = {channel: native_core.KeyExchange(self._comms[channel], channel, timeout)
                          for channel in Channel}
        # atexit runs the last registered first: this runs before exit_hooks' check.
        atexit.register(self._leave_channels)
        self._helper = comm.Dup()
        self._helper_broken = None
        # Point to point between a column-wise table's slice ranks when it is saved.
        self._arrays = comm.Dup()
        self._arrays_broken = None
        # Requests given up on, with their buffers: MPI may not cancel a send (nor a receive already
        # matched) and would then read or write that memory after the wait returned.
        self._abandoned: list = []
        self._mpi = MPI
        self._world_comm = comm
        self._row_comms = {}
        self.exchange_timeout_s = timeout

    def make_row_exchanges(self, exchanges: Iterable[RowExchangeName],
                           grouped: Iterable[Tuple[str, Channel]] = ()) -> None:
        """Communicators for the lookups' row exchanges (channel.RowExchangeName: one for rows, one
        for gradients each), registered with the op library under their names; `grouped`: the
        (feature, channel) pairs looked up in table groups. Called by every rank when its key
        pipeline starts: the ranks first agree on the communicators (channel.agreed_keys: the same
        lookups, each group place any rank has), then create the missing ones in that order, so that
        the pairing does not depend on the order the lookups were built in. Communicators made
        before (a graph built again, as the Estimator does) are kept."""
        from ..embedding import native_ops

        mine = ExchangeNames.of(exchanges, grouped)
        what = "start_asc_pipeline: the row exchanges of the lookups"
        every = [mine]
        if self.size > 1:
            every = [ExchangeNames.from_json(text) for text in self.gather_texts(mine.to_json(), what)]
        try:
            keys = agreed_keys(every)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        for key in keys:
            if key not in self._row_comms:
                comm, request = self._world_comm.Idup()
                self._wait(lambda: request, f"{what} ({key})", 60.0)
                # A peer that sends more rows than this rank expects comes back as an error the row
                # exchange names, instead of MPI ending the job with its own words.
                comm.Set_errhandler(self._mpi.ERRORS_RETURN)
                self._row_comms[key] = comm
            name = mine.name_of(key)
            if name is not None:
                native_ops.register_comm(name, self._row_comms[key].py2f())

    def _leave_channels(self):
        """At a clean exit: a peer still waiting in a key exchange round for this rank (its prefetch
        had started one batch more when the sessions closed), or one that runs a pass after this
        rank left (an evaluation on rank 0 alone), fails that round at once naming this rank,
        instead of waiting for the exchange timeout or passing over this rank's part of the tables."""
        if not exit_hooks.exit_failed():
            for exchange in self.exchanges.values():
                exchange.leave()

    def restart_channels(self) -> None:
        """A channel stopped by an error runs again under a new configuration (every rank calls
        init() at the same point); one whose round timed out stays stopped."""
        for exchange in self.exchanges.values():
            exchange.restart()

    def sum_over_ranks(self, value: int, what: str, timeout: float = 60.0) -> int:
        """Sum of an int over all ranks. Every rank must call it at the same point; a lone caller
        gets an error after `timeout` seconds instead of hanging the job."""
        recv = np.zeros(1, np.int64)
        self._wait(lambda: self._helper.Iallreduce(np.array([value], np.int64), recv, op=self._mpi.SUM), what, timeout)
        return int(recv[0])

    def gather_from_ranks(self, value: int, what: str, timeout: float = 60.0) -> List[int]:
        """Every rank's int (a list indexed by rank); called by all ranks together, as sum_over_ranks."""
        recv = np.zeros(self.size, np.int64)
        self._wait(lambda: self._helper.Iallgather(np.array([value], np.int64), recv), what, timeout)
        return recv.tolist()

    def gather_texts(self, text: str, what: str, timeout: float = 60.0) -> List[str]:
        """Every rank's string, by rank (collective, as sum_over_ranks): used to tell every rank
        what went wrong on each."""
        data = text.encode()
        lengths = self.gather_from_ranks(len(data), what, timeout)
        recv = bytearray(sum(lengths))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
        self._wait(lambda: self._helper.Iallgatherv(data, [recv, lengths, offsets[:-1].tolist(), self._mpi.BYTE]),
                   what, timeout)
        return [bytes(recv[offsets[r]:offsets[r + 1]]).decode() for r in range(self.size)]

    def send_arrays(self, dest: int, arrays: List[np.ndarray], what: str, timeout: float,
                    error: Optional[str] = None) -> None:
        """`arrays` to rank `dest`, which takes them with receive_arrays(this rank) (or, with
        `error`, that text instead, which receive_arrays raises there); an error after `timeout`
        seconds if `dest` does not take them."""
        kept = [np.ascontiguousarray(a) for a in arrays]
        header = json.dumps({"error": error, "arrays": [[a.dtype.str, list(a.shape)] for a in kept]}).encode()
        size = np.array([len(header)], np.int64)
        self._wait_arrays(lambda: [self._arrays.Isend(size, dest, tag=1), self._arrays.Isend(header, dest, tag=2)]
                          + [self._arrays.Isend(a, dest, tag=3) for a in kept], f"{what}: sending to rank {dest}",
                          timeout)

    def receive_arrays(self, source: int, what: str, timeout: float) -> List[np.ndarray]:
        """The arrays rank `source` sends with send_arrays; its error text, if it sent one, as a RuntimeError."""
        waiting = f"{what}: waiting for rank {source}"
        size = np.zeros(1, np.int64)
        self._wait_arrays(lambda: [self._arrays.Irecv(size, source, tag=1)], waiting, timeout)
        header = bytearray(int(size[0]))
        self._wait_arrays(lambda: [self._arrays.Irecv(header, source, tag=2)], waiting, timeout)
        said = json.loads(bytes(header))
        arrays = [np.empty(shape, np.dtype(dtype)) for dtype, shape in said["arrays"]]
        self._wait_arrays(lambda: [self._arrays.Irecv(a, source, tag=3) for a in arrays], waiting, timeout)
        if said["error"] is not None:
            raise RuntimeError(f"{what}: rank {source} failed: {said['error']}")
        return arrays

    def _wait_arrays(self, start, what, timeout):
        """After a timeout the arrays' communicator is not used again: a message sent late would be
        taken for the next save's."""
        if self._arrays_broken:
            raise RuntimeError(f"{what}: {self._arrays_broken}")
        requests = start()
        if not self._done_within(requests, timeout):
            for request in requests:
                request.Cancel()
            self._abandoned.append((start, requests))
            self._arrays_broken = (f"a rank gave no answer within {timeout:.0f} s on an earlier save; the column "
                                   "slices' ranks are out of step: restart the job from its last checkpoint")
            raise TimeoutError(f"{what}: no answer within {timeout:.0f} s (that rank stopped, or saves at another "
                               "step); every rank must save at the same step")

    def _write_stacks(self, what: str) -> None:
        """After a wait for the other ranks timed out: this rank's threads' stacks and, through
        SIGUSR1, those of the other ranks on this host, each to its own stderr, so that the log
        says where every rank was instead of only that one waited."""
        log.error("%s: timed out; the stacks of this rank and of rank(s) %s on this host follow in their logs", what,
                  [peer[0] for peer in self._local_ranks])
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        for _, pid, started in self._local_ranks:
            try:
                if psutil.Process(pid).create_time() == started:
                    os.kill(pid, STACKS_SIGNAL)
            except (OSError, psutil.Error):
                pass  # that rank has ended already
        # The signalled ranks write before this rank's error ends the job (MPI_Abort).
        time.sleep(1.0)

    def _done_within(self, requests, timeout) -> bool:
        deadline = time.monotonic() + timeout
        while not self._mpi.Request.Testall(requests):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def _wait(self, start, what, timeout):
        if self._helper_broken:
            raise RuntimeError(f"{what}: {self._helper_broken}")
        if not self._done_within([start()], timeout):
            self._helper_broken = (f"not every rank called it within {timeout:.0f} s on an earlier call; "
                                   "all ranks must call it together, and the ranks are now out of step")
            self._write_stacks(what)
            raise TimeoutError(f"{what}: not every rank called it within {timeout:.0f} s; all ranks must "
                               "call it together (at the same point of the script)")


def unlink_own_segments() -> None:
    """A process alone in its job (a script run without mpiexec: MPI's singleton) has no daemon that
    removes its shared-memory segment (/dev/shm/sm_segment.*, 16 MiB) when it ends, so every such run
    left one behind. No peer will ever map it: its name goes now, and the mapping stays valid."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(maxsplit=5)[-1].strip() for line in f if "/dev/shm/" in line}
    except OSError:
        return
    for path in paths:
        if os.path.basename(path).startswith(("sm_segment.", "vader_segment.")) and not path.endswith("(deleted)"):
            try:
                os.unlink(path)
            except OSError:
                pass


def get_world() -> "World":
    """The world, created on first use (collective: every rank calls it at the same point)."""
    if _STATE.world is None:
        _STATE.world = World()
    return _STATE.world


@dataclass
class WorldState:
    world: Optional[World] = None  # made by the first get_world(), for the rest of the process


_STATE = WorldState()
