"""A directory that producers drop TFRecord files into, read as a dataset that never ends.

    root/0/, root/1/, ... root/<partitions - 1>/    one folder per partition

A producer writes a file under a name starting with "." and renames it into its partition when
it is complete (a rename is atomic); names starting with "." are never read. A partition's files
are read in the order of their names, so producers name them in the order they write them (a
zero-padded sequence number or timestamp). Partition i is read by rank i % world size: every
record is read by one rank. A rank takes a file from each of its partitions in turn, skipping a
partition with nothing new; with nothing new anywhere it waits, and after idle_timeout_s (None:
never) its data ends, which every rank learns in the same exchange round (key_pipeline.py).

Every checkpoint holds each partition's position as of its step (cursor.py); Saver.restore hands
the saved positions to the stream before its dataset runs, into the same ranks or other ones.
"""
import os
import time
from typing import Dict, Optional

import tensorflow as tf

from ..formats.channel import Channel
from ..formats.stream_positions import PartitionPosition
from ..process import config
from ..process.logs import get_logger
from ..process.state import STATE
from ..process.world import get_world
from ..validation import check_int, check_number
from .cursor import StreamCursor
from .tfrecord_files import StreamFileError, count_records

log = get_logger("shardrec.stream")
WAIT_LOG_S = 30.0


class DirectoryStream:
    def __init__(self, root: str, partitions: int, idle_timeout_s: Optional[float] = None, poll_s: float = 0.2):
        owner = "DirectoryStream"
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise TypeError(f"{owner}: root must be a directory path, got {root!r}")
        check_int(owner, "partitions", partitions, 1, 1 << 20)
        if idle_timeout_s is not None:
            check_number(owner, "idle_timeout_s", idle_timeout_s, 0, None, lo_open=True)
        check_number(owner, "poll_s", poll_s, 0, 60, lo_open=True)
        self.root, self.partitions = os.path.abspath(os.fspath(root)), partitions
        self.idle_timeout_s, self.poll_s = idle_timeout_s, poll_s
        self.names = [str(i) for i in range(partitions)]
        self.owned = []
        self.cursor: Optional[StreamCursor] = None
        self._resume: Optional[str] = None
        self._started = False

    def dataset(self) -> tf.data.Dataset:
        """This rank's records (serialized tf.train.Example strings, or whatever the producer wrote),
        for the user's batch, parse and get_asc_insert_func maps."""
        cfg = config.get_config()
        if self.partitions < cfg.size:
            raise ValueError(f"DirectoryStream({self.root!r}): {self.partitions} partition(s) for {cfg.size} ranks; "
                             "every rank reads at least one: give partitions >= the number of ranks")
        self.owned = [n for i, n in enumerate(self.names) if i % cfg.size == cfg.rank]
        for name in self.names:
            os.makedirs(os.path.join(self.root, name), exist_ok=True)
        self.cursor = StreamCursor({p: PartitionPosition(None, 0) for p in self.owned})
        self._number_batches_from(0)
        STATE.stream = self
        slices = tf.data.Dataset.from_generator(self._slices, output_signature=(
            tf.TensorSpec([], tf.string), tf.TensorSpec([], tf.int64)))
        read = tf.autograph.experimental.do_not_convert(lambda path, first: tf.data.TFRecordDataset(path).skip(first))
        return slices.flat_map(read)

    def restore(self, positions: Dict[str, PartitionPosition], resume: Optional[str], step: int) -> None:
        """Starts this rank's partitions at a checkpoint's positions (Saver.restore calls it).
        resume: the partition whose file this rank's save cut (same ranks only), read first."""
        if self._started:
            raise RuntimeError("DirectoryStream: the checkpoint was restored after the stream's dataset began to "
                               "read; restore before the first run of the dataset's iterator")
        unknown = sorted(set(positions) - set(self.names))
        if unknown:
            raise ValueError(f"DirectoryStream({self.root!r}): the checkpoint has positions of partition(s) {unknown}, "
                             f"which a stream of {self.partitions} partitions does not have; read it with the "
                             "partition count it was saved with")
        self.cursor = StreamCursor({p: positions.get(p, PartitionPosition(None, 0)) for p in self.owned}, step)
        self._resume = resume if resume in self.owned else None
        self._number_batches_from(step)

    @staticmethod
    def _number_batches_from(step: int) -> None:
        """A stream's batches are one per global step from `step` on: the key exchange numbers them
        so, and a save of step T takes back what admission counted of batches T, T+1, ... that
        tf.data looked up ahead (admission/steps.py), as the stream's positions leave their records
        unread."""
        get_world().exchanges[Channel.TRAIN].set_step(step)

    def _slices(self):
        """(file path, first record) of every file slice this rank reads, in order; logged to the cursor."""
        self._started = True
        cursor, owned = self.cursor, self.owned
        # Where each partition's reading stands, and whether that file was handed out whole (then it
        # is neither counted again while waiting for the next one, nor needed if it goes away).
        reading = {p: (pos, False) for p, pos in cursor.initial.items()}
        turn = owned.index(self._resume) if self._resume in owned else 0
        idle_since, said = time.monotonic(), time.monotonic()
        while True:
            for k in range(len(owned)):
                partition = owned[(turn + k) % len(owned)]
                found = self._next_slice(partition, *reading[partition])
                if found is None:
                    continue
                file, first, count = found
                reading[partition] = (PartitionPosition(file, count), True)
                turn = (turn + k + 1) % len(owned)
                idle_since = said = time.monotonic()
                cursor.handed(partition, file, first, count - first)
                yield os.path.join(self.root, partition, file), first
                break
            else:
                now = time.monotonic()
                if self.idle_timeout_s is not None and now - idle_since >= self.idle_timeout_s:
                    log.info("stream %s: nothing new in partition(s) %s for %.0f s (idle_timeout_s): this rank's data "
                             "ends", self.root, ", ".join(owned), now - idle_since)
                    return
                if now - said >= WAIT_LOG_S:
                    log.info("stream %s: waiting for data in partition(s) %s (%.0f s so far)", self.root,
                             ", ".join(owned), now - idle_since)
                    said = now
                time.sleep(self.poll_s)

    def _next_slice(self, partition: str, at: PartitionPosition, whole: bool):
        """(file, first record, record count) of the partition's next unread records, or None.
        whole: `at.file` was handed out to its end."""
        folder = os.path.join(self.root, partition)
        names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
        if not whole and at.file is not None and at.offset > 0:
            if at.file in names:
                count = count_records(os.path.join(folder, at.file), partition)
                if at.offset < count:
                    return at.file, at.offset, count
                if at.offset > count:
                    raise StreamFileError(f"stream partition {partition!r}: {at.file} holds {count} records, but "
                                          f"{at.offset} of them were trained: the file changed after it was read")
            elif at.file not in names:
                raise StreamFileError(f"stream partition {partition!r}: {at.file} was removed before it was read "
                                      f"to its end ({at.offset} records trained); keep a partition's files until a "
                                      "checkpoint holds a later position")
        done = whole or at.offset > 0  # at.file itself is read (or was resumed above)
        for name in names:
            if at.file is not None and (name < at.file or (name == at.file and done)):
                continue
            count = count_records(os.path.join(folder, name), partition)
            if count:
                return name, 0, count
        return None

