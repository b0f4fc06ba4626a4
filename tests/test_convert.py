"""shardrec-convert: TFRecord Examples to Parquet, read back by ParquetDataset as TensorFlow parses
the records; a record that does not match is named by file, number and feature."""
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example(ids, tags, x, user):
    f = tf.train.Feature
    return tf.train.Example(features=tf.train.Features(feature={
        "ids": f(int64_list=tf.train.Int64List(value=ids)), "tags": f(int64_list=tf.train.Int64List(value=tags)),
        "x": f(float_list=tf.train.FloatList(value=[x])), "user": f(bytes_list=tf.train.BytesList(value=[user]))
    })).SerializeToString()


def _records(n, seed):
    rng = np.random.default_rng(seed)
    return [_example(rng.integers(0, 2**40, 3).tolist(), rng.integers(0, 9, rng.integers(0, 4)).tolist(),
                     float(rng.random()), f"u{rng.integers(0, 50)}".encode()) for _ in range(n)]


def _write(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as w:
        for r in records:
            w.write(r)


def convert(*args):
    """The command as a user runs it (a process of its own)."""
    return subprocess.run([sys.executable, "-m", "shardrec.launch.convert_cli", *map(str, args)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))


def convert_here(capsys, *args):
    """The command's main() in this process (no TensorFlow start-up): (exit status, stderr)."""
    from shardrec.launch.convert_cli import main

    code = main(list(map(str, args)))
    return code, capsys.readouterr().err


def test_a_directory_stream_converts_to_parquet_that_reads_as_tensorflow_parses_it(tmp_path, runtime):
    from shardrec.rank_runtime import ParquetDataset

    source = tmp_path / "stream"
    records = {p: _records(300, p) for p in range(2)}
    for p, recs in records.items():
        _write(source / str(p) / "events-00000.tfrecord", recs)
    proc = convert(source, "--out", tmp_path / "pq", "--row-group-rows", 128)
    assert proc.returncode == 0, proc.stderr
    assert "2/2 files, 600 rows" in proc.stderr and "schema: ids fixed_size_list<item: int64 not null>[3]" in \
        proc.stderr
    fast = convert(source, "--out", tmp_path / "fast", "--row-group-rows", 128, "--compression", "none",
                   "--no-dictionary")
    assert fast.returncode == 0, fast.stderr
    for p in range(2):
        a, b = (pq.ParquetFile(tmp_path / d / str(p) / "events-00000.parquet") for d in ("pq", "fast"))
        assert a.read().equals(b.read())
        chunks = [b.metadata.row_group(g).column(c) for g in range(3) for c in range(b.metadata.num_columns)]
        assert {c.compression for c in chunks} == {"UNCOMPRESSED"} and not any(c.has_dictionary_page for c in chunks)
        assert a.metadata.row_group(0).column(0).compression == "SNAPPY"
        assert not any(f.nullable for f in b.schema_arrow), "required columns: no definition levels"
    for p in range(2):
        path = tmp_path / "pq" / str(p) / "events-00000.parquet"
        assert pq.ParquetFile(path).metadata.num_row_groups == 3
        spec = {"ids": tf.io.FixedLenFeature([3], tf.int64), "tags": tf.io.RaggedFeature(tf.int64),
                "x": tf.io.FixedLenFeature([], tf.float32), "user": tf.io.FixedLenFeature([], tf.string)}
        want = tf.io.parse_example(records[p], spec)
        want = dict(want, user=tf.strings.to_hash_bucket_fast(want["user"], 2**63 - 1))
        got = tf.compat.v1.data.make_one_shot_iterator(ParquetDataset(
            [str(path)], 300, {"ids": "ids", "tags": "ids", "x": "float", "user": "id"}, training=False,
            shard=(0, 1))).get_next()
        with tf.compat.v1.Session() as sess:
            got, want = sess.run([got, want])
        for name in ("ids", "x", "user"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        np.testing.assert_array_equal(got["tags"].flat_values, want["tags"].flat_values)
        np.testing.assert_array_equal(got["tags"].row_splits, want["tags"].row_splits)


@pytest.mark.parametrize("case", ["wrong type", "missing feature", "other length", "damaged"])
def test_a_record_that_does_not_match_is_named_and_no_file_is_put_in_place(tmp_path, capsys, case):
    records = _records(1100, 0)  # the bad record past the first 1000, which the schema is inferred from
    if case == "damaged":
        _write(tmp_path / "in" / "a.tfrecord", records)
        with open(tmp_path / "in" / "a.tfrecord", "r+b") as f:
            f.seek(3000)
            f.write(b"\0" * 16)
        message = r"a.tfrecord: record \d+ at byte \d+: the file is damaged or not TFRecord"
    else:
        bad = {"wrong type": _example([1, 2, 3], [], 0.5, b"u"),
               "missing feature": tf.train.Example(features=tf.train.Features(feature={
                   "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=[1, 2, 3]))})).SerializeToString(),
               "other length": _example([1, 2], [], 0.5, b"u")}[case]
        if case == "wrong type":
            example = tf.train.Example.FromString(bad)
            example.features.feature["x"].CopyFrom(tf.train.Feature(int64_list=tf.train.Int64List(value=[1])))
            bad = example.SerializeToString()
        _write(tmp_path / "in" / "a.tfrecord", records[:1050] + [bad] + records[1050:])
        message = {"wrong type": r"a.tfrecord: record 1050: feature 'x' is a int64_list, the schema's is a float_list",
                   "missing feature": r"a.tfrecord: record 1050: feature '\w+' is missing",
                   "other length": r"a.tfrecord: record 1050: feature 'ids' has 2 value\(s\), the schema's 'ids' column "
                                   r"has 3"}[case]
    code, err = convert_here(capsys, tmp_path / "in", "--out", tmp_path / "out", "--row-group-rows", 256)
    assert code == 1 and re.search(message, err), err
    assert not (tmp_path / "out" / "a.parquet").exists()


def test_declared_columns_limit_the_output_and_bad_declarations_are_named(tmp_path, capsys):
    _write(tmp_path / "in" / "a.tfrecord", _records(50, 1))
    code, err = convert_here(capsys, tmp_path / "in", "--out", tmp_path / "out", "--column", "ids=ids:3",
                             "--column", "x=float")
    assert code == 0, err
    assert pq.read_schema(tmp_path / "out" / "a.parquet").names == ["ids", "x"]
    code, err = convert_here(capsys, tmp_path / "in", "--out", tmp_path / "out2", "--column", "ids=vector")
    assert code == 1 and "column 'ids' is declared 'vector'; allowed: id, float, ids, floats" in err
    code, err = convert_here(capsys, tmp_path / "in", "--out", tmp_path / "out2", "--column", "nope=id")
    assert code == 1 and "no feature 'nope' in its first records; its features: ids, tags, user, x" in err
