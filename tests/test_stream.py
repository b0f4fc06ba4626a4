"""Training from a DirectoryStream: files counted by their framing, positions saved with every
checkpoint, and a job killed mid-run and restarted that trains every record exactly once."""
import glob
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from mpi_helpers import check, mpiexec
from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows
from shardrec.rank_runtime.formats.sparse_checkpoint import read_manifest
from shardrec.rank_runtime.formats.stream_positions import PartitionPosition
from shardrec.rank_runtime.stream import StreamFileError
from shardrec.rank_runtime.stream.tfrecord_files import count_records

FIELDS = 3


def produce(root, partitions, files, records, seed=0):
    """`files` files of `records` tf.train.Example records in each partition, written under a
    dot-name and renamed into place as a producer does; returns every record's ids."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**40, size=200)
    written = []
    for f in range(files):
        for p in range(partitions):
            folder = os.path.join(root, str(p))
            os.makedirs(folder, exist_ok=True)
            ids = pool[np.minimum(rng.geometric(0.03, size=(records, FIELDS)) - 1, len(pool) - 1)]
            ys = rng.normal(size=records).astype(np.float32)
            tmp = os.path.join(folder, f".events-{f:05d}.tfrecord")
            with tf.io.TFRecordWriter(tmp) as w:
                for row, y in zip(ids, ys):
                    w.write(tf.train.Example(features=tf.train.Features(feature={
                        "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=row)),
                        "y": tf.train.Feature(float_list=tf.train.FloatList(value=[y]))})).SerializeToString())
            os.rename(tmp, os.path.join(folder, f"events-{f:05d}.tfrecord"))
            written.append(ids)
    return np.concatenate(written)


def test_a_file_is_counted_by_its_framing_and_a_cut_one_is_named(tmp_path):
    produce(tmp_path, 1, 1, 7)
    [path] = glob.glob(str(tmp_path / "0" / "*.tfrecord"))
    assert count_records(path, "0") == 7
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-5])
    with pytest.raises(StreamFileError, match=r"partition '0'.*record 6 at byte \d+ says \d+ bytes, past the file's end"):
        count_records(path, "0")


def test_a_file_read_to_its_end_may_go_and_is_not_counted_again_while_waiting(tmp_path, monkeypatch):
    """The reader alone (no MPI): once a file was handed out whole, waiting for the next one neither
    counts it again at every poll nor needs it (a producer's retention may remove it)."""
    from shardrec.rank_runtime.formats.stream_positions import PartitionPosition as Position
    from shardrec.rank_runtime.stream import directory
    from shardrec.rank_runtime.stream.cursor import StreamCursor

    produce(tmp_path, 1, 2, 5)
    stream = directory.DirectoryStream(tmp_path, 1, idle_timeout_s=0.3, poll_s=0.05)
    stream.owned, stream.cursor = ["0"], StreamCursor({"0": Position(None, 0)})
    counted = []
    monkeypatch.setattr(directory, "count_records", lambda path, p: counted.append(os.path.basename(path)) or 5)
    slices = stream._slices()
    assert [os.path.basename(next(slices)[0]) for _ in range(2)] == ["events-00000.tfrecord", "events-00001.tfrecord"]
    os.remove(tmp_path / "0" / "events-00000.tfrecord")
    os.remove(tmp_path / "0" / "events-00001.tfrecord")
    assert list(slices) == []  # idle for 0.3 s: the data ends, without an error
    assert counted == ["events-00000.tfrecord", "events-00001.tfrecord"]


def _load(out, tag, size):
    parts = [np.load(out / f"{tag}-rank{r}-of{size}.npz") for r in range(size)]
    keys = np.concatenate([p["keys"] for p in parts])
    order = np.argsort(keys)
    return parts, keys[order], np.concatenate([p["values"] for p in parts])[order]


def test_a_rank_killed_mid_run_resumes_every_partition_where_its_checkpoint_stood(tmp_path):
    """4 partitions, 2 ranks, batches of 8: 3 files of 24 records a partition are 18 steps. Rank 1
    is SIGKILLed after step 7 (checkpoints every 5 steps: the latest is step 5, and tf.data had
    read ahead of it); the restarted job resumes from step 5 and ends with the tables, bit for
    bit, of a job that was never stopped (SGD), having trained each record once."""
    stream = tmp_path / "stream"
    ids = produce(stream, 4, 3, 24)
    common = ["--stream", stream, "--partitions", 4, "--out", tmp_path, "--every", 5, "--idle", 2,
              "--access-threshold", 3]
    check(mpiexec(2, "stream_job.py", *common, "--tag", "straight", "--model", tmp_path / "straight", timeout=240))
    killed = mpiexec(2, "stream_job.py", *common, "--tag", "killed", "--model", tmp_path / "resumed", "--die-at", 7,
                     timeout=240)
    assert killed.returncode != 0
    assert tf.train.latest_checkpoint(str(tmp_path / "resumed")).endswith("model-5")
    # A copy of the same checkpoint (its state file naming the copy) restored into 1 rank: it reads
    # all 4 partitions from where they stood.
    shutil.copytree(tmp_path / "resumed", tmp_path / "resized")
    (tmp_path / "resized" / "checkpoint").write_text('model_checkpoint_path: "model-5"\n'
                                                    'all_model_checkpoint_paths: "model-5"\n')
    check(mpiexec(2, "stream_job.py", *common, "--tag", "resumed", "--model", tmp_path / "resumed", timeout=240))
    check(mpiexec(1, "stream_job.py", *common, "--tag", "resized", "--model", tmp_path / "resized", timeout=240))
    straight, keys, values = _load(tmp_path, "straight", 2)
    resumed, resumed_keys, resumed_values = _load(tmp_path, "resumed", 2)
    assert [int(p["step"]) for p in straight] == [18, 18] == [int(p["step"]) for p in resumed]
    assert sum(int(p["records"]) for p in straight) == len(ids)
    assert sum(int(p["records"]) for p in resumed) == len(ids) - 5 * 8 * 2
    seen, times = np.unique(ids, return_counts=True)
    admitted = seen[times >= 3]
    np.testing.assert_array_equal(keys, admitted)
    np.testing.assert_array_equal(resumed_keys, keys)
    np.testing.assert_array_equal(resumed_values, values)
    np.testing.assert_array_equal(resumed[0]["w"], straight[0]["w"])
    [resized] = [np.load(tmp_path / "resized-rank0-of1.npz")]
    assert int(resized["records"]) == len(ids) - 5 * 8 * 2 and int(resized["step"]) == 5 + 26
    np.testing.assert_array_equal(np.sort(resized["keys"]), keys)
    for model, ranks in (("straight", 2), ("resumed", 2), ("resized", 1)):
        final = tf.train.latest_checkpoint(str(tmp_path / model))
        # Admission's counts: every key counted as often as the stream holds it, no batch twice.
        [ckpt] = find_checkpoints(final)
        rows = table_rows(ckpt, "emb")
        counted = np.concatenate([rows["keys"], rows["pending_keys"]])
        counts = np.concatenate([rows["counts"], rows["pending_counts"]])
        order = np.argsort(counted)
        np.testing.assert_array_equal(counted[order], seen, err_msg=model)
        np.testing.assert_array_equal(counts[order], times, err_msg=model)
        shards = [read_manifest(os.path.join(os.path.dirname(final), f"sparse-{os.path.basename(final)}",
                                             f"rank-{r}-of-{ranks}")) for r in range(ranks)]
        positions = {p: pos for m in shards for p, pos in m.stream.partitions.items()}
        assert positions == {str(p): PartitionPosition("events-00002.tfrecord", 24) for p in range(4)}, (model, positions)
