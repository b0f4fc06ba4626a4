"""What the stream tests share: records to write into a directory stream or a Redis stream (with
every record's ids, the oracle of what training must count), a stream's reader run alone, a job
run in the background while a test acts on it, and what a checkpoint counted."""
import os
import threading
import time

import numpy as np
import tensorflow as tf

from mpi_helpers import mpiexec
from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows
from shardrec.rank_runtime.formats.sparse_checkpoint import read_manifest
from shardrec.rank_runtime.stream import pack_records

FIELDS = 3


def draws(partitions, files, records, seed=0):
    """{(file, partition): (ids [records, FIELDS], y [records])}, the same first files whatever
    `files` is."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**40, size=200)
    out = {}
    for f in range(files):
        for p in range(partitions):
            ids = pool[np.minimum(rng.geometric(0.03, size=(records, FIELDS)) - 1, len(pool) - 1)]
            out[f, p] = ids, rng.normal(size=records).astype(np.float32)
    return out


def events(partitions, files, records, seed=0, ids_by_file=None):
    """{(file, partition): serialized tf.train.Example records} of draws(), and every record's ids.
    ids_by_file: a dict that gets each file's ids."""
    out, written = {}, []
    for (f, p), (ids, ys) in draws(partitions, files, records, seed).items():
        out[f, p] = [tf.train.Example(features=tf.train.Features(feature={
            "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=row)),
            "y": tf.train.Feature(float_list=tf.train.FloatList(value=[y]))})).SerializeToString()
            for row, y in zip(ids, ys)]
        written.append(ids)
        if ids_by_file is not None:
            ids_by_file[f, p] = ids
    return out, np.concatenate(written)


def produce_parquet(root, partitions, files, records, seed=0, row_group_rows=10):
    """The records of produce() as Parquet files (ids as scalar columns ids0.., y), written under a
    dot-name and renamed into place; returns every record's ids."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    written = []
    for (f, p), (ids, ys) in draws(partitions, files, records, seed).items():
        folder = os.path.join(root, str(p))
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".events-{f:05d}.parquet")
        pq.write_table(pa.table({**{f"ids{i}": ids[:, i] for i in range(FIELDS)}, "y": ys}), tmp,
                       row_group_size=row_group_rows)
        os.rename(tmp, os.path.join(folder, f"events-{f:05d}.parquet"))
        written.append(ids)
    return np.concatenate(written)


def produce(root, partitions, files, records, seed=0, only_files=None):
    """`files` files of `records` records in each partition, written under a dot-name and renamed
    into place as a producer does; returns every record's ids."""
    by_file, ids = events(partitions, files, records, seed)
    for (f, p), serialized in by_file.items():
        if only_files is not None and f not in only_files:
            continue
        folder = os.path.join(root, str(p))
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".events-{f:05d}.tfrecord")
        with tf.io.TFRecordWriter(tmp) as w:
            for record in serialized:
                w.write(record)
        os.rename(tmp, os.path.join(folder, f"events-{f:05d}.tfrecord"))
    return ids


def publish(url, name, partitions, files, records, seed=0, only_files=None, packs=(1,)):
    """The records of produce(), appended to Redis streams name:0 .. name:<partitions - 1>: a file's
    records in entries of packs[0], packs[1], ... records in turn (an entry of one record as
    `record`, of several packed as `records`)."""
    import redis

    by_file, ids = events(partitions, files, records, seed)
    client = redis.Redis.from_url(url)
    for (f, p), serialized in by_file.items():
        if only_files is None or f in only_files:
            pipe = client.pipeline()
            for entry in entries(serialized, packs):
                pipe.xadd(f"{name}:{p}", {"record": entry[0]} if len(entry) == 1 else {"records": pack_records(entry)})
            pipe.execute()
    return ids


def entries(records, packs):
    out, at, turn = [], 0, 0
    while at < len(records):
        out.append(records[at:at + packs[turn % len(packs)]])
        at, turn = at + len(out[-1]), turn + 1
    return out


def reader(stream, positions, resume=None):
    """The reader of a stream alone (no MPI): this process owns every partition."""
    from shardrec.rank_runtime.stream.cursor import StreamCursor

    stream.owned = list(stream.names)
    stream.cursor = StreamCursor(positions)
    stream._prepare()
    return stream._read(stream.cursor, resume)


def read_all(blocks):
    return [bytes(joined[s:s + n]) for joined, starts, lengths in blocks for s, n in zip(starts, lengths)]


def counted(model):
    """Admission's count of every key in the latest checkpoint of `model`, by key, and the stream
    positions the checkpoint holds."""
    final = tf.train.latest_checkpoint(str(model))
    [ckpt] = find_checkpoints(final)
    rows = table_rows(ckpt, "emb")
    keys = np.concatenate([rows["keys"], rows["pending_keys"]])
    counts = np.concatenate([rows["counts"], rows["pending_counts"]])
    sparse = os.path.join(os.path.dirname(final), f"sparse-{os.path.basename(final)}")
    positions = {p: pos for shard in os.listdir(sparse) if shard.startswith("rank-")
                 for p, pos in read_manifest(os.path.join(sparse, shard)).stream.partitions.items()}
    order = np.argsort(keys)
    return keys[order], counts[order], positions, int(final.rsplit("-", 1)[1])


def job_in_background(ranks, *args, timeout=240):
    """stream_job.py on `ranks` ranks in a thread: (the thread, a dict that gets its "proc")."""
    result = {}
    job = threading.Thread(target=lambda: result.update(proc=mpiexec(ranks, "stream_job.py", *args, timeout=timeout)))
    job.start()
    return job, result


def wait_for_blocked_readers(url, readers, job, result, timeout=60):
    """Until `readers` clients of the Redis server at `url` wait in XREAD BLOCK: the ranks' readers
    found nothing new after their last look and wait on the broker for more."""
    import redis

    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    while sum(c.get("cmd") == "xread" for c in client.client_list()) < readers:
        assert job.is_alive() and time.monotonic() < deadline, \
            f"the readers never waited on the broker again (their data ended?): {result}"
        time.sleep(0.05)


def wait_for_file(path, job, result, timeout=180):
    """Until `path` exists (a checkpoint the job wrote, say), while the job runs."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert job.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.1)
