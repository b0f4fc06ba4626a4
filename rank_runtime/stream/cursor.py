"""Which records each training step took from the stream.

tf.data reads ahead of training, so the stream's positions at a save are not what the reader has
reached but what the trained batches held. The reader logs every file slice it hands to tf.data
(partition, file, first record, record count), in order; the key pipeline reports every training
batch it exchanges, with its number of samples, in the same order (the pipeline between them keeps
one sample per record, in order: batch and map, not filter or shuffle). Batch b's positions are
those after the first (samples of batches 0..b) records handed out. A save of global step T holds
the positions after T - start batches (one batch per global step, as admission's counts need too).
"""
import collections
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import numpy as np

from ..formats.stream_positions import PartitionPosition, StreamPositions

HISTORY = 1024  # batches kept: far more than any prefetch reads ahead


@dataclass
class _Slice:
    partition: str
    file: str
    first: int  # the record of `file` it starts at
    records: int
    taken: int = 0
    entries: Optional["_Entries"] = None  # a broker's slice

    def position(self) -> PartitionPosition:
        if self.entries is None:
            return PartitionPosition(self.file, self.first)
        return self.entries.position(self.taken)


class _Entries:
    """A broker's slice (redis_streams.py): its entries' ids and record counts, where the partition
    stood before it (the last entry done, how many entries were, and how many records of the first
    entry of the slice were trained before it)."""

    def __init__(self, ids: Sequence[bytes], counts: np.ndarray, before: PartitionPosition):
        self.ids, self.before = ids, before
        self.ends = np.cumsum(counts)  # records of the slice up to the end of each entry

    def position(self, taken: int) -> PartitionPosition:
        done = int(np.searchsorted(self.ends, taken, side="right"))  # entries trained to their end
        if not done:
            return PartitionPosition(self.before.file, self.before.offset, self.before.within + taken)
        last = self.ids[done - 1]
        return PartitionPosition(last.decode() if isinstance(last, bytes) else last, self.before.offset + done,
                                 taken - int(self.ends[done - 1]))


class StreamCursor:
    def __init__(self, positions: Dict[str, PartitionPosition], start_step: int = 0):
        self._lock = threading.Lock()
        self._handed = collections.deque()  # _Slice, oldest first: handed out, not yet in a batch
        self.initial = dict(positions)  # where reading starts
        self._positions = dict(positions)  # after the last batch exchanged
        self._resume: Optional[str] = None
        self.start_step = start_step
        self._batches = 0
        self._history = collections.OrderedDict({0: (dict(positions), None)})
        self.records_trained = 0

    def handed(self, partition: str, file: str, first: int, records: int) -> None:
        with self._lock:
            self._handed.append(_Slice(partition, file, first, records))

    def handed_entries(self, partition: str, ids: Sequence[bytes], counts: np.ndarray,
                       before: PartitionPosition) -> None:
        """A broker's entries: their ids, the records of each handed out (the first's without those
        trained before), and the partition's position before them."""
        with self._lock:
            self._handed.append(_Slice(partition, "", 0, int(counts.sum()), entries=_Entries(ids, counts, before)))

    def batch_exchanged(self, samples: int) -> None:
        with self._lock:
            left = samples
            while left:
                if not self._handed:
                    raise RuntimeError(
                        f"stream: a training batch of {samples} samples holds more than the stream handed out: the "
                        "pipeline between the stream and get_asc_insert_func must keep one sample per record, in "
                        "order (batch and map; no filter, shuffle or repeat)")
                head = self._handed[0]
                took = min(left, head.records)
                head.first += took
                head.taken += took
                head.records -= took
                left -= took
                self._positions[head.partition] = head.position()
                self._resume = head.partition
                if not head.records:
                    self._handed.popleft()
            self.records_trained += samples
            self._batches += 1
            self._history[self._batches] = (dict(self._positions), self._resume)
            while len(self._history) > HISTORY:
                self._history.popitem(last=False)

    def latest(self) -> Dict[str, PartitionPosition]:
        """The positions after the last batch exchanged."""
        with self._lock:
            return dict(self._positions)

    def positions_at(self, step: int) -> StreamPositions:
        """The positions after the batches of global steps start..step-1."""
        with self._lock:
            batches = step - self.start_step
            if batches not in self._history:
                raise RuntimeError(
                    f"stream: a save of global step {step} needs the stream's positions after {batches} batches since "
                    f"step {self.start_step}, but the key pipeline has exchanged {self._batches} (positions are kept "
                    f"for the last {HISTORY}): a job that trains from a stream runs one batch per global step")
            positions, resume = self._history[batches]
            return StreamPositions(positions, resume)
