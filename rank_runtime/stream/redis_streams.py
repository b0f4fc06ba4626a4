"""Redis Streams read as a training dataset that never ends.

    <name>:0, <name>:1, ... <name>:<partitions - 1>    one Redis stream a partition

A producer appends each record (a serialized tf.train.Example, or whatever the user's parse
function reads) with `XADD <name>:<p> * record <bytes>`, or many records in one entry with
`XADD <name>:<p> * records <the bytes of a TFRecord file>` (pack_records() makes them): a packed
entry costs the broker and the reader one entry's work, which at a record an entry is most of the
cost (bench/README.md). Redis gives every entry an id (milliseconds-sequence) that orders its
partition. Partition i is read by rank i % world size.

The checkpoint, not a consumer group, holds what was trained: a group's acknowledgements would run
ahead of a save (tf.data reads ahead) or behind it (a crash after the save), and exactly once
needs the position of the save's own step. A partition's position is the id of the last entry
trained to its end, the number of such entries, and the records trained of the next one (a save
may cut a packed entry): a restore reads from the entry after that id (an exclusive XRANGE),
skipping those records, and the count shows entries not yet trained that were trimmed away
(XTRIM, MAXLEN), which is an error naming the partition, never a silent skip.

Reading order is a function of the data alone while the data is there: the partitions in turn, a
block from each, so that a job restored into the same ranks builds the batches of a job that
never stopped. A block is a packed entry, or `block_entries` entries of a record each, aligned to
the partition's count of entries: a packed entry is to a partition what a file is to a
directory's, and a partition with a backlog does not hold the turn for block_entries of them.
With nothing new anywhere the reader waits on the broker (XREAD BLOCK); after idle_timeout_s of
that (None: never) its data ends, which every rank learns in the same exchange round. A broker
that goes away is waited for (and logged): reading goes on from the same entry when it answers
again, and the time it was away does not count as idle.
"""
import time
from typing import Dict, Optional

import numpy as np
import tensorflow as tf

from ...native import framing
from ..formats.stream_positions import PartitionPosition
from ..process.logs import get_logger
from ..validation import check_int, check_number
from .partitioned import WAIT_LOG_S, PartitionedStream, PartitionLag
from .tfrecord_files import StreamFileError, pack_records

log = get_logger("shardrec.stream")
START = "0-0"  # before every entry id
# Records handed to tf.data at a time, at most (fewer when no more is there): from_generator costs
# about 0.7 ms of CPU a call here, 2.9 us a record at 256 records a call (bench/README.md).
YIELD_RECORDS = 8192


def _millis(entry_id) -> int:
    """The time part of a Redis entry id (milliseconds-sequence)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(text.split("-")[0])


def _unchanged(response, **options):
    return response


def _named(fields) -> dict:
    """An entry's [field, value, ...] as a dict."""
    return dict(zip(fields[::2], fields[1::2]))


class _Pending:
    """Reads not yet handed to tf.data, in order: one call of from_generator's for several."""

    def __init__(self):
        self.parts, self.records = [], 0

    def add(self, joined: bytes, starts: np.ndarray, lengths: np.ndarray) -> int:
        self.parts.append((joined, starts, lengths))
        self.records += len(starts)
        return self.records

    def take(self):
        parts, self.parts, self.records = self.parts, [], 0
        if len(parts) == 1:
            return parts[0]
        shifts = np.cumsum([0] + [len(joined) for joined, _, _ in parts[:-1]])
        return (b"".join(joined for joined, _, _ in parts), np.concatenate([s + d for (_, s, _), d in zip(parts, shifts)]),
                np.concatenate([n for _, _, n in parts]))


class StreamBrokerError(ConnectionError):
    """A broker that cannot be reached when the stream is built."""


class RedisStream(PartitionedStream):
    def __init__(self, url: str, name: str, partitions: int, idle_timeout_s: Optional[float] = None,
                 poll_s: float = 0.2, block_entries: int = 1024, field: str = "record", packed_field: str = "records",
                 connect_timeout_s: float = 5.0):
        owner = "RedisStream"
        for what, value in (("url", url), ("name", name), ("field", field), ("packed_field", packed_field)):
            if not isinstance(value, str) or not value:
                raise TypeError(f"{owner}: {what} must be a non-empty string, got {value!r}")
        if field == packed_field:
            raise ValueError(f"{owner}: field and packed_field are both {field!r}; an entry holds one record in "
                             "`field` or several in `packed_field`, so they differ")
        check_number(owner, "poll_s", poll_s, 0, 60, lo_open=True)
        check_int(owner, "block_entries", block_entries, 1, 1 << 20)
        check_number(owner, "connect_timeout_s", connect_timeout_s, 0, 600, lo_open=True)
        super().__init__(owner, f"{name} at {url}", partitions, idle_timeout_s)
        self.url, self.name = url, name
        self.field, self.packed_field = field.encode(), packed_field.encode()
        self.poll_s, self.block_entries, self.connect_timeout_s = poll_s, block_entries, connect_timeout_s
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
        # XRANGE's reply as hiredis parses it, [[id, [field, value, ...]], ...]: redis-py's own
        # callback makes a dict an entry, which cost more than the parse itself (bench/README.md).
        self.client.set_response_callback("XRANGE", _unchanged)
        try:
            self.client.ping()
        except redis.exceptions.RedisError as e:
            raise StreamBrokerError(f"RedisStream: the broker at {self.url} did not answer within "
                                    f"{self.connect_timeout_s:g} s ({e}); start it, or give the url of one that "
                                    "runs") from None

    def _records(self) -> tf.data.Dataset:
        # A block's records travel as one string and their (start, length) in it: no Python object a record.
        blocks = tf.data.Dataset.from_generator(self._generator, output_signature=(
            tf.TensorSpec([], tf.string), tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64)))
        return blocks.map(tf.autograph.experimental.do_not_convert(tf.strings.substr)).unbatch()

    def _read(self, cursor, resume):
        """Records in reading order, as (bytes joined, starts, lengths) of YIELD_RECORDS or of what
        there is; every read logged to the cursor."""
        import redis

        owned, block, pending = self.owned, self.block_entries, _Pending()
        reading = dict(cursor.initial)
        self._check_untrimmed(reading)
        packed = {p: False for p in owned}  # whether the partition's last entry read was packed
        turn = 0
        if resume in owned:  # the save cut its block, or ended it: then the next partition goes on
            turn = (owned.index(resume) + self._block_ended(resume, reading[resume])) % len(owned)
        idle_since = warned = time.monotonic()
        away_since = None
        while True:
            try:
                if away_since is not None:
                    # The idle clock starts when the broker answers: an empty read right after an
                    # outage would otherwise measure the outage as idle time and end the data.
                    self.client.ping()
                    # A broker back without the entries read (restarted without its append-only
                    # file, or replaced) would otherwise be read on from ids it never had.
                    self._check_untrimmed(reading)
                    log.info("stream %s: the broker answers again after %.0f s away; reading goes on", self.source,
                             time.monotonic() - away_since)
                    away_since, idle_since = None, time.monotonic()
                for k in range(len(owned)):
                    partition = owned[(turn + k) % len(owned)]
                    at = reading[partition]
                    want = 1 if packed[partition] else block - at.offset % block
                    entries = self.client.xrange(self.key(partition), f"({at.file or START}", "+", count=want)
                    if not entries:
                        continue
                    ids, joined, starts, lengths, counts, packed[partition] = self._entries(partition, entries, at)
                    cursor.handed_entries(partition, ids, counts, at)
                    reading[partition] = PartitionPosition(ids[-1].decode(), at.offset + len(ids))
                    # The next partition's turn only once this block is whole (aligned blocks).
                    turn = (turn + k + (packed[partition] or reading[partition].offset % block == 0)) % len(owned)
                    idle_since = time.monotonic()
                    self._has_data()
                    if pending.add(joined, starts, lengths) >= YIELD_RECORDS:
                        yield pending.take()
                    break
                else:
                    if pending.records:  # what there is goes to training before any wait
                        yield pending.take()
                        continue
                    if self._wait_ends(time.monotonic() - idle_since):
                        return
                    # Wakes as soon as any partition has an entry after its position.
                    self.client.xread({self.key(p): reading[p].file or START for p in owned}, count=1,
                                      block=max(1, int(self.poll_s * 1000)))
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                now = time.monotonic()
                if away_since is None or now - warned >= WAIT_LOG_S:
                    log.warning("stream %s: the broker does not answer (%s); waiting for it (%.0f s away so far), "
                                "reading goes on from the same entries when it is back", self.source, e,
                                0.0 if away_since is None else now - away_since)
                    warned = now
                if away_since is None:
                    away_since = now
                if pending.records:
                    yield pending.take()
                if self._asked_to_stop():
                    return
                time.sleep(self.poll_s)

    def lag(self) -> Dict[str, PartitionLag]:
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

    def _entries(self, partition: str, entries, at: PartitionPosition):
        """The entries up to the first packed one (the end of a block): their ids (bytes: decoded
        only where a position needs one), their records (bytes joined, starts, lengths) without
        those of the first entry trained before (at.within), the records of each entry handed out,
        and whether the last is packed (has no `field`). hiredis (installed with the project) parses
        the reply in C, and redis-py's dict an entry is skipped (_unchanged)."""
        field = self.field
        single = [fields[1] if len(fields) == 2 and fields[0] == field else _named(fields).get(field)
                  for _, fields in entries]
        if None in single:  # a packed entry ends its block: the entries after it wait for the next turn
            entries = entries[:single.index(None) + 1]
            single = single[:len(entries)]
        ids = [entry_id for entry_id, _ in entries]
        if None not in single:  # a record an entry: no framing to check
            lengths = np.fromiter(map(len, single), dtype=np.int64, count=len(single))
            starts = np.cumsum(lengths) - lengths
            joined, counts = b"".join(single), np.ones(len(ids), np.int64)
        else:
            blobs = [self._packed(partition, entry_id, fields) for entry_id, fields in entries]
            joined, starts, lengths, counts = self._framed(partition, ids, blobs)
        if at.within:
            if at.within >= counts[0]:
                raise StreamFileError(
                    f"stream partition {partition!r}: entry {ids[0].decode()} of Redis stream {self.key(partition)!r} "
                    f"holds {counts[0]} records, but {at.within} of them were trained: the entry changed after it "
                    "was read (the stream was replaced)")
            starts, lengths = starts[at.within:], lengths[at.within:]
            counts = counts.copy()
            counts[0] -= at.within
        return ids, joined, starts, lengths, counts, single[-1] is None

    def _block_ended(self, partition: str, at: PartitionPosition) -> bool:
        """Whether a position is at the end of a block: a packed entry read to its end, or the
        partition's count of entries a multiple of block_entries."""
        if at.within or at.file is None:
            return not at.within
        if at.offset % self.block_entries == 0:
            return True
        last = self.client.xrange(self.key(partition), at.file, at.file, count=1)
        return bool(last) and _named(last[0][1]).get(self.field) is None

    def _packed(self, partition: str, entry_id: bytes, fields) -> bytes:
        """An entry's records as TFRecord framing: a packed entry's own bytes, or its one record framed."""
        fields = _named(fields)
        packed = fields.get(self.packed_field)
        if packed is not None:
            return packed
        record = fields.get(self.field)
        if record is None:
            raise StreamFileError(
                f"stream partition {partition!r}: entry {entry_id.decode()} of Redis stream {self.key(partition)!r} "
                f"has no field {self.field.decode()!r} or {self.packed_field.decode()!r} (it has "
                f"{sorted(f.decode() for f in fields)}); producers write one record an entry as XADD "
                f"{self.key(partition)} * {self.field.decode()} <record>, or several as XADD {self.key(partition)} "
                f"* {self.packed_field.decode()} <pack_records(records)>")
        return pack_records([record])

    def _framed(self, partition: str, ids, blobs):
        framed = framing.frame_tfrecords(blobs)
        if framed.bad_blob >= 0:
            bad = framed.bad_blob
            raise StreamFileError(
                f"stream partition {partition!r}: entry {ids[bad].decode()} of Redis stream {self.key(partition)!r}: "
                f"record {framed.counts[bad]} at byte {framed.bad_offset} of its {self.packed_field.decode()!r} "
                f"field: {framed.bad_reason}; a packed entry holds the bytes of a TFRecord file (pack_records())")
        return b"".join(blobs), framed.starts, framed.lengths, framed.counts

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
                    f"added, but {at.offset} were read (up to entry {at.file}): the stream was deleted or "
                    "replaced; train a new model from it, or restore the stream")
            if length < added - at.offset:
                raise StreamFileError(
                    f"stream partition {partition!r}: {added - at.offset - length} entries of Redis stream "
                    f"{self.key(partition)!r} after entry {at.file or START} (position {at.offset}) were trimmed "
                    "before they were trained; trim a partition only up to the position of a checkpoint (XTRIM "
                    "MINID), or restore a later checkpoint")
