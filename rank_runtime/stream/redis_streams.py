"""Redis Streams read as a training dataset that never ends.

    <name>:0, <name>:1, ... <name>:<partitions - 1>    one Redis stream a partition

A producer appends each record (a serialized tf.train.Example, or whatever the user's parse
function reads) with `XADD <name>:<p> * record <bytes>`; Redis gives every entry an id
(milliseconds-sequence) that orders its partition. Partition i is read by rank i % world size.

The checkpoint, not a consumer group, holds what was trained: a group's acknowledgements would run
ahead of a save (tf.data reads ahead) or behind it (a crash after the save), and exactly once
needs the position of the save's own step. A partition's position is the id of the last entry
trained and the number of entries trained in all: a restore reads from the entry after that id
(an exclusive XRANGE), and the count shows entries not yet trained that were trimmed away (XTRIM,
MAXLEN), which is an error naming the partition, never a silent skip.

Reading order is a function of the data alone while the data is there: the partitions in turn, a
block of `block_records` entries from each, blocks aligned to the partition's count, so that a
job restored into the same ranks builds the batches of a job that never stopped. With nothing new
anywhere the reader waits on the broker (XREAD BLOCK); after idle_timeout_s of that (None: never)
its data ends, which every rank learns in the same exchange round. A broker that goes away is
waited for (and logged): reading goes on from the same entry when it answers again, and the time
it was away does not count as idle.
"""
import time
from typing import Optional

import numpy as np
import tensorflow as tf

from ..formats.stream_positions import PartitionPosition
from ..process.logs import get_logger
from ..validation import check_int, check_number
from .partitioned import WAIT_LOG_S, PartitionedStream, PartitionLag
from .tfrecord_files import StreamFileError

log = get_logger("shardrec.stream")
START = "0-0"  # before every entry id


def _millis(entry_id) -> int:
    """The time part of a Redis entry id (milliseconds-sequence)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(text.split("-")[0])


class StreamBrokerError(ConnectionError):
    """A broker that cannot be reached when the stream is built."""


class RedisStream(PartitionedStream):
    def __init__(self, url: str, name: str, partitions: int, idle_timeout_s: Optional[float] = None,
                 poll_s: float = 0.2, block_records: int = 1024, field: str = "record", connect_timeout_s: float = 5.0):
        owner = "RedisStream"
        for what, value in (("url", url), ("name", name), ("field", field)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"{owner}: {what} must be a non-empty string, got {value!r}")
        check_number(owner, "poll_s", poll_s, 0, 60, lo_open=True)
        check_int(owner, "block_records", block_records, 1, 1 << 20)
        check_number(owner, "connect_timeout_s", connect_timeout_s, 0, 600, lo_open=True)
        super().__init__(owner, f"{name} at {url}", partitions, idle_timeout_s)
        self.url, self.name, self.field = url, name, field.encode()
        self.poll_s, self.block_records, self.connect_timeout_s = poll_s, block_records, connect_timeout_s
        self.client = None

    def key(self, partition: str) -> str:
        return f"{self.name}:{partition}"

    def _prepare(self) -> None:
        import redis

        try:
            # The socket's timeout outlasts a blocking read of poll_s.
            self.client = redis.Redis.from_url(self.url, socket_connect_timeout=self.connect_timeout_s,
                                               socket_timeout=self.connect_timeout_s + self.poll_s)
        except ValueError as e:
            raise ValueError(f"RedisStream: url {self.url!r} is not a Redis URL ({e}); allowed: "
                             "redis://host:port[/db] or unix:///path/to/socket") from None
        try:
            self.client.ping()
        except redis.exceptions.RedisError as e:
            raise StreamBrokerError(f"RedisStream: the broker at {self.url} did not answer within "
                                    f"{self.connect_timeout_s:g} s ({e}); start it, or give the url of one that "
                                    "runs") from None

    def _records(self) -> tf.data.Dataset:
        blocks = tf.data.Dataset.from_generator(self._generator, output_signature=tf.TensorSpec([None], tf.string))
        return blocks.unbatch()

    def _read(self, cursor, resume):
        """Blocks of records (1-D arrays of bytes) in reading order; logged to the cursor."""
        import redis

        owned = self.owned
        reading = dict(cursor.initial)
        self._check_untrimmed(reading)
        turn = 0
        if resume in owned:  # the save cut its block, or ended it: then the next partition goes on
            turn = (owned.index(resume) + (reading[resume].offset % self.block_records == 0)) % len(owned)
        idle_since = warned = time.monotonic()
        away_since = None
        while True:
            try:
                for k in range(len(owned)):
                    partition = owned[(turn + k) % len(owned)]
                    at = reading[partition]
                    want = self.block_records - at.offset % self.block_records
                    entries = self.client.xrange(self.key(partition), f"({at.file or START}", "+", count=want)
                    if not entries:
                        continue
                    ids, records = self._entries(partition, entries)
                    cursor.handed_entries(partition, ids, at.offset)
                    reading[partition] = PartitionPosition(ids[-1].decode(), at.offset + len(ids))
                    # The next partition's turn only once this block is whole (aligned blocks).
                    turn = (turn + k + (len(ids) == want)) % len(owned)
                    idle_since = time.monotonic()
                    self._has_data()
                    yield records
                    break
                else:
                    if self._wait_ends(time.monotonic() - idle_since):
                        return
                    # Wakes as soon as any partition has an entry after its position.
                    self.client.xread({self.key(p): reading[p].file or START for p in owned}, count=1,
                                      block=max(1, int(self.poll_s * 1000)))
                if away_since is not None:
                    log.info("stream %s: the broker answers again after %.0f s; reading goes on", self.source,
                             time.monotonic() - away_since)
                    away_since, idle_since = None, time.monotonic()
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                now = time.monotonic()
                if away_since is None or now - warned >= WAIT_LOG_S:
                    log.warning("stream %s: the broker does not answer (%s); waiting for it (%.0f s so far), "
                                "reading goes on from the same entries when it is back", self.source, e,
                                0.0 if away_since is None else now - away_since)
                    warned = now
                away_since = away_since or now
                if self._wait_ends(0.0):  # asked to stop
                    return
                time.sleep(self.poll_s)

    def lag(self):
        import redis

        out = {}
        for partition, at in self.cursor.latest().items():
            try:
                info = self.client.xinfo_stream(self.key(partition))
            except redis.exceptions.ResponseError:  # no such stream yet
                out[partition] = PartitionLag(at.offset, 0, 0.0)
                continue
            behind = max(0, int(info["entries-added"]) - at.offset)
            seconds = 0.0
            if behind:
                first = info.get("first-entry")
                since = at.file or (first[0] if first else info["last-generated-id"])
                seconds = max(0.0, (_millis(info["last-generated-id"]) - _millis(since)) / 1000)
            out[partition] = PartitionLag(at.offset, behind, seconds)
        return out

    def _entries(self, partition: str, entries):
        """The block's entry ids (bytes: decoded only where a position needs one) and records. With
        hiredis (installed with the project) redis-py parses the reply in C: about 2.4 us an entry
        here, against 11 us in Python (bench/README.md)."""
        ids = [entry_id for entry_id, _ in entries]
        records = [fields.get(self.field) for _, fields in entries]
        if None in records:
            bad, fields = entries[records.index(None)]
            raise StreamFileError(
                f"stream partition {partition!r}: entry {bad.decode()} of Redis stream {self.key(partition)!r} has no "
                f"field {self.field.decode()!r} (it has {sorted(f.decode() for f in fields)}); producers write "
                f"each record as XADD {self.key(partition)} * {self.field.decode()} <record>")
        return ids, np.array(records, dtype=object)

    def _check_untrimmed(self, reading) -> None:
        """Refuses positions whose next entries are gone (trimmed, or the stream was replaced)."""
        import redis

        for partition, at in reading.items():
            try:
                info = self.client.xinfo_stream(self.key(partition))
            except redis.exceptions.ResponseError:
                info = {"entries-added": 0, "length": 0}  # no such stream yet
            added, length = int(info["entries-added"]), int(info["length"])
            if added < at.offset:
                raise StreamFileError(
                    f"stream partition {partition!r}: Redis stream {self.key(partition)!r} has had {added} entries "
                    f"added, but {at.offset} were trained (up to entry {at.file}): the stream was deleted or "
                    "replaced; train a new model from it, or restore the stream")
            if length < added - at.offset:
                raise StreamFileError(
                    f"stream partition {partition!r}: {added - at.offset - length} entries of Redis stream "
                    f"{self.key(partition)!r} after entry {at.file or START} (position {at.offset}) were trimmed "
                    "before they were trained; trim a partition only up to the position of a checkpoint (XTRIM "
                    "MINID), or restore a later checkpoint")
