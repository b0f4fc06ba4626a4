"""What every stream source shares: partitions "0".."P-1" (partition i is read by rank i % world
size, so every record is read by one rank), the cursor of what training took from them, and the
restore of a checkpoint's positions into the same ranks or other ones.

A source defines _prepare() (checks made when the dataset is built, on every rank) and
_read(cursor, resume) (a generator of what tf.data reads, logging every slice it hands out to the
cursor), and the dataset of its records (_records)."""
import time
from dataclasses import dataclass
from typing import Dict, Optional

import tensorflow as tf

from ..formats.channel import Channel
from ..formats.stream_positions import PartitionPosition
from ..process import batch_events, config, heartbeat, metrics, resize
from ..process.logs import get_logger
from ..process.world import get_world
from ..validation import check_int, check_number
from .cursor import StreamCursor

WAIT_LOG_S = 30.0  # a waiting reader says so this often
log = get_logger("shardrec.stream")


def _own_threads() -> tf.data.Options:
    """The input pipeline's own thread pool. The reader waits for data inside tf.data (a
    from_generator call that sleeps or blocks on the broker); on the session's inter-op pool, one
    thread on a rank of one core (host_defaults.py), that wait would hold the only thread, and the
    batches already read would not train until new data came (a pinned 2-rank job hung so)."""
    import psutil

    options = tf.data.Options()
    options.threading.private_threadpool_size = max(2, len(psutil.Process().cpu_affinity()))
    return options


@dataclass(frozen=True)
class PartitionLag:
    """Where training stands in a partition: records it took, records not taken yet, and the
    seconds between the newest record and the last one taken (0 when none is left)."""
    trained: int
    records: int
    seconds: float


class PartitionedStream(batch_events.Observer):
    def __init__(self, owner: str, source: str, partitions: int, idle_timeout_s: Optional[float]):
        check_int(owner, "partitions", partitions, 1, 1 << 20)
        if idle_timeout_s is not None:
            check_number(owner, "idle_timeout_s", idle_timeout_s, 0, None, lo_open=True)
        self.source = source  # for messages: the folder, or the broker and stream name
        self.partitions, self.idle_timeout_s = partitions, idle_timeout_s
        self.names = [str(i) for i in range(partitions)]
        self.owned = []
        self.cursor: Optional[StreamCursor] = None
        self._resume: Optional[str] = None
        self._started = False
        self._waiting = False
        self._said = 0.0  # when the wait was last logged

    def dataset(self) -> tf.data.Dataset:
        """This rank's records (serialized tf.train.Example strings, or whatever the producer wrote),
        for the user's batch, parse and get_asc_insert_func maps."""
        cfg = config.get_config()
        if self.partitions < cfg.size:
            raise ValueError(f"{type(self).__name__}({self.source}): {self.partitions} partition(s) for {cfg.size} "
                             "ranks; every rank reads at least one: give partitions >= the number of ranks")
        self.owned = [n for i, n in enumerate(self.names) if i % cfg.size == cfg.rank]
        self._prepare()
        self.cursor = StreamCursor({p: PartitionPosition(None, 0) for p in self.owned})
        self._number_batches_from(0)
        before = training_stream()
        if before is not None:
            batch_events.unregister(before)
        batch_events.register(self)  # from here on the stream this process trains from
        resize.stop_on_sigterm()
        metrics.start_progress_lines()
        return self._records().with_options(_own_threads())

    def restore(self, positions: Dict[str, PartitionPosition], resume: Optional[str], step: int) -> None:
        """Starts this rank's partitions at a checkpoint's positions (Saver.restore calls it).
        resume: the partition whose slice this rank's save cut (same ranks only), read first."""
        if self._started:
            raise RuntimeError(f"{type(self).__name__}: the checkpoint was restored after the stream's dataset began "
                               "to read; restore before the first run of the dataset's iterator")
        unknown = sorted(set(positions) - set(self.names))
        if unknown:
            raise ValueError(f"{type(self).__name__}({self.source}): the checkpoint has positions of partition(s) "
                             f"{unknown}, which a stream of {self.partitions} partitions does not have; read it with "
                             "the partition count it was saved with")
        self.cursor = StreamCursor({p: positions.get(p, PartitionPosition(None, 0)) for p in self.owned}, step)
        self._resume = resume if resume in self.owned else None
        self._number_batches_from(step)

    def batch_exchanged(self, event: batch_events.BatchExchanged) -> None:
        """The records of a training batch are trained (the key pipeline's thread, batch_events.py)."""
        if event.channel == Channel.TRAIN:
            self.cursor.batch_exchanged(event.examples)

    def _generator(self):
        self._started = True
        return self._read(self.cursor, self._resume)

    def _wait_ends(self, waited_s: float) -> bool:
        """Called while the reader has nothing new to hand out (it then sleeps or blocks briefly):
        whether its data ends now, because the job was asked to stop or idle_timeout_s passed. Says
        every WAIT_LOG_S that it waits."""
        now = time.monotonic()
        if self._waiting and now - self._said >= WAIT_LOG_S:
            log.info("stream %s: waiting for data in partition(s) %s (%.0f s so far)", self.source,
                     ", ".join(self.owned), waited_s)
            self._said = now
        if self._asked_to_stop():
            return True
        if self.idle_timeout_s is not None and waited_s >= self.idle_timeout_s:
            log.info("stream %s: nothing new in partition(s) %s for %.0f s (idle_timeout_s): this rank's data ends",
                     self.source, ", ".join(self.owned), waited_s)
            return True
        return False

    def _asked_to_stop(self) -> bool:
        """Called while the reader waits (for data, or for a broker that does not answer): whether
        the job was asked to stop, which ends this rank's data."""
        if not self._waiting:
            self._waiting, self._said = True, time.monotonic()
            heartbeat.waiting_for_data(True)
        if resize.requested():
            log.info("stream %s: the job was asked to stop while waiting for data: this rank's data ends", self.source)
            return True
        return False

    def _has_data(self) -> None:
        if self._waiting:
            self._waiting = False
            heartbeat.waiting_for_data(False)

    @staticmethod
    def _number_batches_from(step: int) -> None:
        """A stream's batches are one per global step from `step` on: the key exchange numbers them
        so, and a save of step T takes back what admission counted of batches T, T+1, ... that
        tf.data looked up ahead (admission/steps.py), as the stream's positions leave their records
        unread."""
        get_world().exchanges[Channel.TRAIN].set_step(step)

    def lag(self) -> Dict[str, PartitionLag]:
        """Every partition of this rank, as of the last training batch (metrics.py asks)."""
        raise NotImplementedError

    def _prepare(self) -> None:
        raise NotImplementedError

    def _records(self) -> tf.data.Dataset:
        raise NotImplementedError

    def _read(self, cursor: StreamCursor, resume: Optional[str]):
        raise NotImplementedError


def training_stream() -> Optional[PartitionedStream]:
    """The stream this process trains from: the one whose dataset() was built last since init()
    (a batch observer until terminate_config_initializer()), or None."""
    return next((o for o in batch_events.observers() if isinstance(o, PartitionedStream)), None)
