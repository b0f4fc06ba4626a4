"""ParquetDataset in one process: every column kind against pyarrow's own reading of the files
(and TensorFlow's string hash), the rows each rank reads, seeded shuffles, and bad input."""
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

N = 1000


def _table(seed=0, n=N):
    rng = np.random.default_rng(seed)
    ids = rng.integers(-2**62, 2**62, n)
    lists = [rng.integers(0, 1 << 40, rng.integers(0, 5)).tolist() for _ in range(n)]
    return pa.table({
        "id": ids,
        "small": pa.array(rng.integers(0, 1000, n), pa.int32()),
        "user": pa.array([f"user-{x % 97}" for x in ids]),
        "tags": pa.array(lists, pa.list_(pa.int64())),
        "tag_w": pa.array([[float(i) for i in range(len(lst))] for lst in lists], pa.list_(pa.float32())),
        "words": pa.array([[f"w{v % 13}" for v in lst] for lst in lists], pa.list_(pa.string())),
        "pair": pa.FixedSizeListArray.from_arrays(pa.array(rng.integers(0, 100, 2 * n)), 2),
        "dense": pa.FixedSizeListArray.from_arrays(pa.array(rng.random(3 * n), pa.float32()), 3),
        "x": rng.random(n),  # float64: converted
        "label": pa.array(rng.integers(0, 2, n), pa.int8()),
        "unused": pa.array(["never read"] * n),
    })


def _write(directory, table, files=3, row_group_rows=64):
    os.makedirs(directory, exist_ok=True)
    bounds = np.linspace(0, table.num_rows, files + 1).astype(int)
    for i in range(files):
        pq.write_table(table.slice(bounds[i], bounds[i + 1] - bounds[i]),
                       os.path.join(directory, f"part-{i:02d}.parquet"), row_group_size=row_group_rows)
    return directory


COLUMNS = {"id": "id", "small": "id", "user": "id", "tags": "ids", "tag_w": "floats", "words": "ids", "pair": "ids",
           "dense": "floats", "x": "float", "label": "float"}


def _read_all(dataset):
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    out = []
    with tf.compat.v1.Session() as sess:
        while True:
            try:
                out.append(sess.run(batch))
            except tf.errors.OutOfRangeError:
                return out


def _hash(strings):
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        return sess.run(tf.strings.to_hash_bucket_fast(strings, 2**63 - 1))


def _flat(batches, name):
    return np.concatenate([b[name].flat_values if hasattr(b[name], "flat_values") else b[name] for b in batches])


def test_every_column_kind_reads_as_pyarrow_reads_the_files(tmp_path, runtime):
    from shardrec.rank_runtime import ParquetDataset

    table = _table()
    _write(tmp_path / "d", table)
    batches = _read_all(ParquetDataset(str(tmp_path / "d"), 96, COLUMNS, drop_remainder=False))
    assert [len(b["id"]) for b in batches] == [96] * (N // 96) + [N % 96]
    assert set(batches[0]) == set(COLUMNS), "only the declared columns"
    want = table.to_pydict()
    np.testing.assert_array_equal(_flat(batches, "id"), want["id"])
    np.testing.assert_array_equal(_flat(batches, "small"), want["small"])
    np.testing.assert_array_equal(_flat(batches, "user"), _hash(want["user"]))
    np.testing.assert_array_equal(_flat(batches, "tags"), [v for lst in want["tags"] for v in lst])
    splits = np.concatenate([[0]] + [np.cumsum([len(r) for r in b["tags"].to_list()]) for b in batches])
    assert [len(r) for b in batches for r in b["tags"].to_list()] == [len(lst) for lst in want["tags"]], splits
    np.testing.assert_array_equal(_flat(batches, "tag_w"), np.float32([v for lst in want["tag_w"] for v in lst]))
    np.testing.assert_array_equal(_flat(batches, "words"), _hash([v for lst in want["words"] for v in lst]))
    np.testing.assert_array_equal(_flat(batches, "pair"), np.array(want["pair"]))
    np.testing.assert_array_equal(_flat(batches, "dense"), np.float32(want["dense"]))
    np.testing.assert_array_equal(_flat(batches, "x"), np.float32(want["x"]))
    np.testing.assert_array_equal(_flat(batches, "label"), np.float32(want["label"]))
    assert batches[0]["x"].dtype == np.float32 and batches[0]["pair"].shape == (96, 2)


def test_drop_remainder_gives_static_batches_and_leaves_the_last_rows(tmp_path, runtime):
    from shardrec.rank_runtime import ParquetDataset

    _write(tmp_path / "d", _table())
    dataset = ParquetDataset(str(tmp_path / "d"), 96, {"id": "id", "pair": "ids"})
    assert dataset.element_spec["id"].shape.as_list() == [96]
    assert dataset.element_spec["pair"].shape.as_list() == [96, 2]
    assert len(_read_all(dataset)) == N // 96


def test_every_row_is_read_by_one_rank_and_a_seeded_shuffle_is_the_same_on_every_rank(tmp_path, graph):
    from shardrec.rank_runtime import ParquetDataset

    table = _table()
    _write(tmp_path / "d", table, files=4, row_group_rows=50)
    ids = np.array(table.column("id"))

    def read(rank, size, seed=None, epochs=1):
        return _flat(_read_all(ParquetDataset(str(tmp_path / "d"), 7, {"id": "id"}, training=False, shard=(rank, size),
                                              partitions=4, num_epochs=epochs, shuffle_seed=seed,
                                              drop_remainder=False)), "id")

    for size in (1, 2, 3):
        parts = [read(r, size) for r in range(size)]
        assert sorted(np.concatenate(parts).tolist()) == sorted(ids.tolist()), size
    plain = read(0, 2)
    shuffled = [read(0, 2, seed=5, epochs=2), read(0, 2, seed=5, epochs=2)]
    np.testing.assert_array_equal(shuffled[0], shuffled[1])
    first, second = np.split(shuffled[0], 2)
    assert sorted(first.tolist()) == sorted(plain.tolist()) == sorted(second.tolist())
    assert first.tolist() != plain.tolist() and first.tolist() != second.tolist(), "each epoch has its own order"
    assert read(0, 2, seed=6).tolist() != first.tolist()


def test_a_shuffled_read_moves_every_column_of_a_row_together(tmp_path, graph):
    """Shuffled, with batches that straddle row groups (batch 96, row groups of 64): every row of
    every kind (ragged lists and their weights, hashed strings, fixed-size lists, a stacked group)
    arrives whole, each row once, as pyarrow reads it."""
    from shardrec.rank_runtime import ParquetDataset

    table = _table()
    _write(tmp_path / "d", table)
    columns = {"id": "id", "tags": "ids", "tag_w": "floats", "words": "ids", "pair": "ids", "dense": "floats",
               "cat": ("id", ["small", "user"])}
    batches = _read_all(ParquetDataset(str(tmp_path / "d"), 96, columns, training=False, shard=(0, 1),
                                       shuffle_seed=3, drop_remainder=False))
    got = _flat(batches, "id")
    want = table.to_pydict()
    assert sorted(got.tolist()) == sorted(want["id"]) and got.tolist() != want["id"]
    row = {v: i for i, v in enumerate(want["id"])}
    for b in batches:
        lists = {name: b[name].to_list() for name in ("tags", "tag_w", "words")}
        for k, i in enumerate(row[v] for v in b["id"]):
            assert lists["tags"][k] == want["tags"][i], (k, i)
            assert lists["tag_w"][k] == [float(x) for x in want["tag_w"][i]]
            assert lists["words"][k] == (_hash(want["words"][i]).tolist() if want["words"][i] else [])
            assert b["pair"][k].tolist() == want["pair"][i] and np.allclose(b["dense"][k], want["dense"][i])
            assert b["cat"][k].tolist() == [want["small"][i], _hash([want["user"][i]])[0]]


def _damage_row_group(path):
    """Overwrites bytes in the middle of the file's first column chunk (its footer stays whole)."""
    meta = pq.ParquetFile(path).metadata.row_group(0).column(0)
    with open(path, "r+b") as f:
        f.seek(meta.data_page_offset + 8)
        f.write(b"\xff" * 64)


BAD = {
    "missing column": (lambda d: None, {"nope": "id"}, r"part-00.parquet' has no column 'nope'; its columns: id, "),
    "wrong type": (lambda d: None, {"user": "float"}, r"column 'user' is string; declared 'float', it must be float32"),
    "list for a scalar": (lambda d: None, {"tags": "id"}, r"column 'tags' is a list \(list<element: int64>\), but it is "
                                                          r"declared 'id'"),
    "scalar for a list": (lambda d: None, {"id": "ids"}, r"column 'id' is int64, not a list; declared 'ids'"),
    "empty file": (lambda d: open(os.path.join(d, "part-01.parquet"), "wb").close(), {"id": "id"},
                   r"part-01.parquet' is empty \(0 bytes\), not a Parquet file"),
    "not parquet": (lambda d: open(os.path.join(d, "part-01.parquet"), "wb").write(b"x" * 100), {"id": "id"},
                    r"part-01.parquet' cannot be read as Parquet .*damaged or of another format"),
    "no rows": (lambda d: pq.write_table(_table().slice(0, 0), os.path.join(d, "part-01.parquet")), {"id": "id"},
                r"part-01.parquet' holds no rows"),
    "schemas differ": (lambda d: pq.write_table(_table().cast(_table().schema.set(
        0, pa.field("id", pa.int32())), safe=False), os.path.join(d, "part-02.parquet")), {"id": "id"},
        r"part-02.parquet': column 'id' is int32, but in .*part-00.parquet' it is int64: every file must have the same"),
    "unknown kind": (lambda d: None, {"id": "int"}, r"column 'id' is declared 'int'; allowed kinds: 'id', 'ids', "),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_naming_the_file_and_column(tmp_path, runtime, case):
    from shardrec.rank_runtime import ParquetDataset

    damage, columns, message = BAD[case]
    d = _write(tmp_path / "d", _table())
    damage(str(d))
    with pytest.raises((ValueError, TypeError), match=message):
        ParquetDataset(str(d), 10, columns)


@pytest.mark.parametrize("case", ["damaged row group", "null values"])
def test_a_row_group_that_does_not_read_stops_the_reader_naming_it(tmp_path, runtime, case):
    from shardrec.rank_runtime import ParquetDataset

    d = _write(tmp_path / "d", _table(), files=1)
    path = os.path.join(d, "part-00.parquet")
    if case == "null values":
        table = _table()
        pq.write_table(table.set_column(0, "id", pa.array([None] + table.column("id").to_pylist()[1:], pa.int64())),
                       path, row_group_size=64)
        message = r"part-00.parquet' row group 0, column 'id': missing values \(null\)"
    else:
        _damage_row_group(path)
        message = r"part-00.parquet' row group 0, column 'id': cannot be read .*the file is damaged"
    with pytest.raises(tf.errors.OpError, match=message):
        _read_all(ParquetDataset(str(d), 10, {"id": "id", "x": "float"}))


def test_bad_parameters_are_named(tmp_path, runtime):
    from shardrec.rank_runtime import ParquetDataset

    d = _write(tmp_path / "d", _table(), files=1, row_group_rows=500)
    with pytest.raises(ValueError, match=r"parameter 'batch_size' = 0 is out of range"):
        ParquetDataset(str(d), 0, {"id": "id"})
    with pytest.raises(ValueError, match=r"the files hold 2 row group\(s\) for 3 partitions"):
        ParquetDataset(str(d), 10, {"id": "id"}, partitions=3)
    with pytest.raises(ValueError, match=r"'shard' is for a dataset read outside shardrec's training"):
        ParquetDataset(str(d), 10, {"id": "id"}, shard=(0, 1))
    with pytest.raises(ValueError, match=r"directory .* holds no \*.parquet file"):
        ParquetDataset(str(tmp_path), 10, {"id": "id"})


def test_a_batch_is_a_view_of_arrow_s_buffers_or_one_aligned_copy(tmp_path):
    """What a batch hands to tf.data: a column of the declared dtype is a view of the buffer Arrow
    decoded into (no copy); whatever is made here (a widened column, hashed strings, row splits)
    starts on a 64-byte boundary, so TensorFlow adopts it without a second copy."""
    from shardrec.rank_runtime.input.columns import Column, batch_arrays

    pq.write_table(_table(), tmp_path / "t.parquet")
    table = pq.read_table(tmp_path / "t.parquet").slice(64, 128)
    columns = [Column("id", "id", 0), Column("small", "id", 0), Column("user", "id", 0), Column("tags", "ids", 0),
               Column("pair", "ids", 2)]
    out = batch_arrays(table, columns)
    arrow = {c: np.frombuffer(table.column(c).chunk(0).buffers()[1], np.int64) for c in ("id",)}
    assert np.shares_memory(out["id"], arrow["id"])
    pair_values = np.frombuffer(table.column("pair").chunk(0).values.buffers()[1], np.int64)
    assert np.shares_memory(out["pair"], pair_values)
    for made in ("small", "user", "tags/row_splits"):
        assert out[made].ctypes.data % 64 == 0, made
    # A batch is cut from the row group's arrays as views: the stacked group, made once, is one.
    from shardrec.rank_runtime.input.parquet import Piece

    columns.append(Column("small", "id", 0, group="cat", slot=0, width=1))
    columns[1] = Column("x", "float", 0)
    piece = Piece.of(table, columns)
    batch = piece.cut(8, 40).arrays()
    assert np.shares_memory(batch["id"], arrow["id"]) and np.shares_memory(batch["cat"], piece.arrays()["cat"])
    assert batch["cat"].ctypes.data % 64 == 0 and batch["tags/row_splits"][0] == 0
    np.testing.assert_array_equal(batch["cat"][:, 0], np.array(table.column("small"))[8:40])


def test_a_group_of_scalar_columns_is_one_stacked_tensor(tmp_path, runtime):
    from shardrec.rank_runtime import ParquetDataset

    table = _table()
    _write(tmp_path / "d", table)
    dataset = ParquetDataset(str(tmp_path / "d"), 100, {"cat": ("id", ["id", "small", "user"]), "x": "float"})
    assert dataset.element_spec["cat"].shape.as_list() == [100, 3]
    cat = np.concatenate([b["cat"] for b in _read_all(dataset)])
    want = table.to_pydict()
    np.testing.assert_array_equal(cat, np.stack([want["id"], want["small"], _hash(want["user"])], axis=1))
    with pytest.raises(ValueError, match=r"group 'cat' is \('ids', \['tags'\]\); a group stacks one or more scalar"):
        ParquetDataset(str(tmp_path / "d"), 10, {"cat": ("ids", ["tags"])})
    with pytest.raises(ValueError, match=r"column 'x' is declared twice"):
        ParquetDataset(str(tmp_path / "d"), 10, {"cat": ("float", ["x"]), "x": "float"})


def _drop(folder, name, table, row_group_rows=64):
    """A producer's file: written under a dot-name, renamed into place."""
    os.makedirs(folder, exist_ok=True)
    pq.write_table(table, os.path.join(folder, "." + name), row_group_size=row_group_rows)
    os.rename(os.path.join(folder, "." + name), os.path.join(folder, name))


def test_a_parquet_directory_stream_reads_on_from_a_position_and_stops_at_a_file_of_another_schema(tmp_path):
    """The stream's reader alone (no MPI): from a saved position (row 100 of the first file) it hands
    out every later row once, in batches that cross row groups and files, a fixed-size list as
    ragged rows, as pyarrow reads them; a file whose column changed type stops it, naming the file."""
    from shardrec.rank_runtime import ParquetDirectoryStream
    from shardrec.rank_runtime.formats.stream_positions import PartitionPosition
    from stream_helpers import reader

    table = _table()
    _drop(tmp_path / "0", "a.parquet", table.slice(0, 400))
    _drop(tmp_path / "0", "b.parquet", table.slice(400, 300), row_group_rows=50)
    columns = {"id": "id", "pair": "ids", "tags": "ids", "x": "float"}
    stream = ParquetDirectoryStream(tmp_path, 1, 64, columns, idle_timeout_s=0.3, poll_s=0.05)
    batches = list(reader(stream, {"0": PartitionPosition("a.parquet", 100)}))
    assert [len(b["id"]) for b in batches] == [64] * 9  # 600 rows: 9 full batches, 24 left (drop_remainder)
    want = table.slice(100, 576).to_pydict()
    np.testing.assert_array_equal(np.concatenate([b["id"] for b in batches]), want["id"])
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), np.float32(want["x"]))
    for name in ("pair", "tags"):
        rows = [list(b[name + "/values"][s:e]) for b in batches
                for s, e in zip(b[name + "/row_splits"][:-1], b[name + "/row_splits"][1:])]
        assert rows == want[name], name
    _drop(tmp_path / "0", "c.parquet", table.cast(table.schema.set(0, pa.field("id", pa.int32())), safe=False))
    with pytest.raises(ValueError, match=r"ParquetDirectoryStream: '.*/0/c.parquet': column 'id' is int32, but in "
                                         r"'.*/0/a.parquet' it is int64"):
        list(reader(stream, {"0": PartitionPosition("b.parquet", 300)}))
