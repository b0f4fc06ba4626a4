"""Training from a Redis stream with its broker misbehaving: entries without the record, trimmed or
damaged, named; a broker that does not answer at start, or goes away for longer than
idle_timeout_s, or comes back without its entries."""
import re
import time

import numpy as np
import pytest

from mpi_helpers import check, mpiexec
from shardrec.launch.redis_server import RedisServer, free_port
from shardrec.rank_runtime.formats.stream_positions import PartitionPosition
from shardrec.rank_runtime.stream import StreamFileError, pack_records
from stream_helpers import (counted, entries, job_in_background, publish, read_all, reader, wait_for_blocked_readers,
                            wait_for_file)


def test_a_broker_entry_without_the_record_or_trimmed_before_training_is_named(broker, tmp_path):
    import redis

    from shardrec.rank_runtime.stream import RedisStream

    client, name = redis.Redis.from_url(broker.url), tmp_path.name
    first = client.xadd(f"{name}:0", {"record": b"a"}).decode()
    bad = client.xadd(f"{name}:0", {"payload": b"b"}).decode()
    stream = RedisStream(broker.url, name, 1, idle_timeout_s=0.2, poll_s=0.05, block_entries=4)
    blocks = reader(stream, {"0": PartitionPosition(None, 0)})
    with pytest.raises(StreamFileError, match=rf"partition '0': entry {bad} of Redis stream '{name}:0' has no field "
                                              r"'record' or 'records' \(it has \['payload'\]\)"):
        next(blocks)
    # Both entries trimmed away, of which one was never trained: refused, before anything is read.
    client.xtrim(f"{name}:0", maxlen=0)
    with pytest.raises(StreamFileError, match=rf"1 entries of Redis stream '{name}:0' after entry {first} "
                                              r"\(position 1\) were trimmed before they were trained"):
        next(reader(stream, {"0": PartitionPosition(first, 1)}))
    # Trained to its end, then trimmed (retention after a checkpoint): nothing to read, no error.
    assert list(reader(stream, {"0": PartitionPosition(bad, 2)})) == []


def test_packed_entries_resume_after_any_record_and_a_bad_one_is_named(broker, tmp_path):
    """Entries of 5, 1, 7, 3 and 4 records (one of them a single `record`), read in blocks of 2
    entries: cut after any of the 20 records, the position the cursor gives resumes with exactly
    the records after it. A packed entry that is not TFRecord framing stops the reader, named."""
    import redis

    from shardrec.rank_runtime.stream import RedisStream

    client, name = redis.Redis.from_url(broker.url), tmp_path.name
    records = [f"record {i}".encode() * (i % 3 + 1) for i in range(20)]
    for entry in entries(records, (5, 1, 7, 3, 4)):
        client.xadd(f"{name}:0", {"record": entry[0]} if len(entry) == 1 else {"records": pack_records(entry)})
    stream = RedisStream(broker.url, name, 1, idle_timeout_s=0.05, poll_s=0.02, block_entries=2)
    assert read_all(reader(stream, {"0": PartitionPosition(None, 0)})) == records
    for k in range(21):
        assert read_all(reader(stream, {"0": PartitionPosition(None, 0)})) == records  # hands out every entry
        if k:
            stream.cursor.batch_exchanged(k)
        at = stream.cursor.latest()["0"]
        assert (at.within > 0) == (k not in (0, 5, 6, 13, 16, 20)), (k, at)  # inside an entry, or at its end
        assert read_all(reader(stream, {"0": at}, "0")) == records[k:], (k, at)
    # A position inside the first entry (5 records) that says 5 of them were trained: not this stream.
    with pytest.raises(StreamFileError, match=r"holds 5 records, but 5 of them were trained: the entry changed"):
        read_all(reader(stream, {"0": PartitionPosition(None, 0, 5)}, "0"))
    bad = client.xadd(f"{name}:0", {"records": pack_records([b"fine"]) + b"not TFRecord framing"}).decode()
    with pytest.raises(StreamFileError, match=rf"partition '0': entry {bad} of Redis stream '{name}:0': record 1 at "
                                              r"byte 20 of its 'records' field: the CRC of its length does not match"):
        read_all(reader(stream, {"0": at}))


def test_a_broker_that_does_not_answer_at_start_is_named(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}/0"
    proc = mpiexec(1, "stream_job.py", "--stream", "events", "--broker", url, "--partitions", 1, "--out", tmp_path,
                   "--tag", "t", "--model", tmp_path / "model", timeout=120)
    assert proc.returncode != 0
    assert f"RedisStream: the broker at {url} did not answer within 5 s" in proc.stderr, proc.stderr[-3000:]
    assert "start it, or give the url of one that runs" in proc.stderr


def test_a_broker_away_longer_than_idle_timeout_loses_nothing(tmp_path):
    """2 ranks train the first file of each of 2 partitions, the broker is SIGKILLed and, 7 s later
    (idle_timeout_s is 4), started again on its append-only file; a second later the rest is
    published. The job waits for the broker (time away is not idle time), goes on, and at its end
    every key was counted once per occurrence in the stream."""
    server = RedisServer(str(tmp_path / "redis")).start()
    name, model = "events", tmp_path / "model"
    ids = publish(server.url, name, 2, 3, 24, only_files={0})
    job, result = job_in_background(2, "--stream", name, "--broker", server.url, "--partitions", 2, "--out", tmp_path,
                                    "--tag", "away", "--model", model, "--every", 2, "--idle", 4,
                                    "--access-threshold", 2)
    try:
        wait_for_file(model / "model-2.index", job, result)
        server.stop(kill=True)
        time.sleep(7)  # the outage itself: its length is what the test sets, longer than idle_timeout_s
        server.start()
        # New entries only once both readers came back, looked, found nothing and wait on the
        # broker: a reader that counted the outage as idle time ends its data at that look.
        wait_for_blocked_readers(server.url, 2, job, result)
        publish(server.url, name, 2, 3, 24, only_files={1, 2})
        job.join(240)
    finally:
        server.stop()
    proc = check(result["proc"])
    assert "the broker does not answer" in proc.stderr, proc.stderr[-3000:]
    away = [int(s) for s in re.findall(r"the broker answers again after (\d+) s away", proc.stderr)]
    assert len(away) == 2 and min(away) >= 6, proc.stderr[-3000:]  # each rank's reader says so
    parts = [np.load(tmp_path / f"away-rank{r}-of2.npz") for r in range(2)]
    assert sum(int(p["records"]) for p in parts) == len(ids)
    keys, counts, _, _ = counted(model)
    seen, times = np.unique(ids, return_counts=True)
    np.testing.assert_array_equal(keys, seen)
    np.testing.assert_array_equal(counts, times)


def test_a_broker_that_comes_back_without_its_entries_is_named(tmp_path):
    """The broker is SIGKILLed mid-run and a new one, without the old one's append-only file, starts
    on its port with a few new entries: the job stops with an error naming the partition and what
    happened, instead of reading on as if the entries trained were there."""
    import redis

    server = RedisServer(str(tmp_path / "redis")).start()
    name, model = "events", tmp_path / "model"
    publish(server.url, name, 1, 2, 24, only_files={0})
    job, result = job_in_background(1, "--stream", name, "--broker", server.url, "--partitions", 1, "--out", tmp_path,
                                    "--tag", "lost", "--model", model, "--every", 2, "--idle", 4)
    fresh = RedisServer(str(tmp_path / "fresh"), port=server.port)
    try:
        wait_for_file(model / "model-2.index", job, result)
        # Entry ids are millisecond-sequence pairs; 24 entries may span milliseconds, so the id the
        # error names is checked against the old broker's own list, not derived from the count.
        old_ids = [i.decode() for i, _ in redis.Redis.from_url(server.url).xrange(f"{name}:0")]
        server.stop(kill=True)
        fresh.start()
        publish(fresh.url, name, 1, 2, 2, seed=1, only_files={1})
        job.join(240)
    finally:
        fresh.stop()
    proc = result["proc"]
    assert proc.returncode != 0
    said = re.search(rf"stream partition '0': Redis stream '{name}:0' has had [02] entries added, but (\d+) were read "
                     r"\(up to entry (\d+-\d+)\): the stream was deleted or replaced", proc.stderr)
    assert said and int(said[1]) >= 16, proc.stderr[-3000:]  # 2 batches of 8 were trained
    assert said[2] == old_ids[int(said[1]) - 1], (said[0], old_ids)
