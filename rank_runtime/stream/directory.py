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

from ..formats.stream_positions import PartitionPosition
from ..process.logs import get_logger
from ..validation import check_number
from .partitioned import PartitionedStream, PartitionLag
from .tfrecord_files import StreamFileError, count_records

log = get_logger("shardrec.stream")


class DirectoryStream(PartitionedStream):
    def __init__(self, root: str, partitions: int, idle_timeout_s: Optional[float] = None, poll_s: float = 0.2):
        owner = "DirectoryStream"
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise TypeError(f"{owner}: root must be a directory path, got {root!r}")
        check_number(owner, "poll_s", poll_s, 0, 60, lo_open=True)
        self.root = os.path.abspath(os.fspath(root))
        super().__init__(owner, repr(self.root), partitions, idle_timeout_s)
        self.poll_s = poll_s
        self._counts = {}  # (partition, file name) -> (bytes, records): a complete file never changes

    def _count(self, partition: str, name: str) -> int:
        path = os.path.join(self.root, partition, name)
        size = os.path.getsize(path)
        known = self._counts.get((partition, name))
        if known is None or known[0] != size:
            known = (size, self._count_file(path, partition))
            self._counts[partition, name] = known
        return known[1]

    def _count_file(self, path: str, partition: str) -> int:
        """The records of a complete file (checked on the way)."""
        return count_records(path, partition)

    def lag(self) -> Dict[str, PartitionLag]:
        out = {}
        for partition, at in self.cursor.latest().items():
            folder = os.path.join(self.root, partition)
            names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
            counts = {n: self._count(partition, n) for n in names}
            trained = sum(c for n, c in counts.items() if at.file is not None and n < at.file) + at.offset
            behind = sum(c for n, c in counts.items() if at.file is None or n > at.file) + \
                max(0, counts.get(at.file, at.offset) - at.offset)
            seconds = 0.0
            if behind:
                times = {n: os.path.getmtime(os.path.join(folder, n)) for n in names}
                current = times.get(at.file, min(times.values()))
                seconds = max(0.0, max(times.values()) - current)
            out[partition] = PartitionLag(trained, behind, seconds)
        return out

    def _prepare(self) -> None:
        for name in self.names:
            os.makedirs(os.path.join(self.root, name), exist_ok=True)

    def _records(self) -> tf.data.Dataset:
        slices = tf.data.Dataset.from_generator(self._generator, output_signature=(
            tf.TensorSpec([], tf.string), tf.TensorSpec([], tf.int64)))
        read = tf.autograph.experimental.do_not_convert(lambda path, first: tf.data.TFRecordDataset(path).skip(first))
        return slices.flat_map(read)

    def _read(self, cursor, resume):
        """(file path, first record) of every file slice this rank reads, in order."""
        for path, first, _ in self._file_slices(cursor, resume):
            yield path, first

    def _file_slices(self, cursor, resume):
        """(file path, first record, records in the file) of every file slice this rank reads, in
        order; each logged to the cursor as it is handed out."""
        owned = self.owned
        # Where each partition's reading stands, and whether that file was handed out whole (then it
        # is neither counted again while waiting for the next one, nor needed if it goes away).
        reading = {p: (pos, False) for p, pos in cursor.initial.items()}
        turn = 0
        if resume in owned:
            # The save cut this partition's file, or ended exactly at its end: then the job that
            # never stopped went on with the next partition.
            at = cursor.initial[resume]
            path = os.path.join(self.root, resume, at.file or "")
            ended = at.file is not None and (not os.path.exists(path) or self._count(resume, at.file) <= at.offset)
            turn = (owned.index(resume) + ended) % len(owned)
        idle_since = time.monotonic()
        while True:
            for k in range(len(owned)):
                partition = owned[(turn + k) % len(owned)]
                found = self._next_slice(partition, *reading[partition])
                if found is None:
                    continue
                file, first, count = found
                reading[partition] = (PartitionPosition(file, count), True)
                turn = (turn + k + 1) % len(owned)
                idle_since = time.monotonic()
                self._has_data()
                cursor.handed(partition, file, first, count - first)
                yield os.path.join(self.root, partition, file), first, count
                break
            else:
                if self._wait_ends(time.monotonic() - idle_since):
                    return
                time.sleep(self.poll_s)

    def _next_slice(self, partition: str, at: PartitionPosition, whole: bool):
        """(file, first record, record count) of the partition's next unread records, or None.
        whole: `at.file` was handed out to its end."""
        folder = os.path.join(self.root, partition)
        names = sorted(n for n in os.listdir(folder) if not n.startswith("."))
        if not whole and at.file is not None and at.offset > 0:
            if at.file in names:
                count = self._count(partition, at.file)
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
            count = self._count(partition, name)
            if count:
                return name, 0, count
        return None

