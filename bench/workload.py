"""The benchmark's data and its two feeds.

Ids follow a Zipf law of exponent 1.1 spread over a 2^40 key range: by default as numpy draws it
(P(k) ~ k^-1.1 over every k >= 1, what users' own benchmarks draw: about 45k distinct ids in a batch
of 4096 x 26), or truncated to `distinct` keys (fewer distinct ids per batch: about 30k for 10M).
Deterministic under a seed.

Feeds, the same for every peer:
- records (a user's path, the default): the batches written once as TFRecord files of
  tf.train.Example, one per sample, read back by tf.data, batched and parsed (parse_example on the
  batch, as TensorFlow's guide advises), each peer parsing the one feature it reads;
- step-only: the batches handed over from numpy by tf.numpy_function, 64-byte aligned (no parsing,
  no copy): the sparse step with nothing around it.
"""
import hashlib
import os
import tempfile

import numpy as np

KEY_RANGE = 2**40


def zipf_ranks(rng, n, distinct, exponent=1.1):
    """Ranks in [0, distinct) with P(r) ~ 1 / (r + 1)^exponent."""
    cdf = np.cumsum(np.arange(1, distinct + 1, dtype=np.float64) ** -exponent)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, rng.random(n)), distinct - 1)


def rank_to_key(ranks):
    # An odd multiplier is a bijection mod 2^40: distinct ranks stay distinct keys, spread out.
    return (ranks.astype(np.int64) * 0x9E3779B97F % KEY_RANGE).astype(np.int64)


def aligned(array):
    """A copy of `array` whose data starts on a 64-byte boundary. A batch handed to TensorFlow by
    tf.numpy_function is adopted without a copy only when so aligned; numpy's own arrays are
    16-byte aligned, and every peer's feed then paid a copy of each batch (1.3 MB) in its step."""
    buf = np.empty(array.nbytes + 64, np.uint8)
    start = -buf.ctypes.data % 64
    out = buf[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def make_batches(num_batches, batch, fields, distinct, seed=0):
    """(keys [num_batches, batch, fields] int64, dense row ids of the same shape in [0, U),
    U = number of distinct keys that occur); each batch's data 64-byte aligned. distinct: 0 for
    numpy's unbounded Zipf(1.1), else the number of keys the law is truncated to. Drawn once per
    machine and kept under the temporary directory (drawing 1600 x 256 x 26 ids truncated to 10M
    keys takes 6 s, which every run of the same data paid before its first step)."""
    folder = os.path.join(tempfile.gettempdir(), "shardrec-bench-batches",
                          f"{num_batches}x{batch}x{fields}-d{distinct}-s{seed}")
    try:
        keys, rows = np.load(os.path.join(folder, "keys.npy")), np.load(os.path.join(folder, "rows.npy"))
    except (OSError, ValueError):
        keys, rows = _draw_batches(num_batches, batch, fields, distinct, seed)
        _keep(folder, keys=keys, rows=rows)
    if (batch * fields * 4) % 64 == 0:  # every batch of both then starts on a boundary too
        keys, rows = aligned(keys), aligned(rows)
    return keys, rows, int(rows.max()) + 1


def load_batches(path, rank=0, size=1):
    """make_batches' triple for keys read from an .npy of [batches, batch, fields] int64 (the
    single-core loop's keys, ../shared/limit/gen_keys.py), rank `rank` of `size` starting at batch
    rank x batches / size so that the ranks train different batches."""
    keys = np.load(path)
    if keys.ndim != 3 or keys.dtype != np.int64:
        raise ValueError(f"{path}: expected [batches, batch, fields] int64 keys, got {keys.dtype} {keys.shape}")
    keys = np.roll(keys, -rank * len(keys) // size, axis=0)
    _, rows = np.unique(keys, return_inverse=True)
    rows = rows.reshape(keys.shape).astype(np.int32)
    if (keys.shape[1] * keys.shape[2] * 4) % 64 == 0:
        keys, rows = aligned(keys), aligned(rows)
    return keys, rows, int(rows.max()) + 1


def _draw_batches(num_batches, batch, fields, distinct, seed):
    rng = np.random.default_rng(seed)
    n = num_batches * batch * fields
    ranks = (rng.zipf(1.1, n) - 1 if not distinct else zipf_ranks(rng, n, distinct)).reshape(num_batches, batch, fields)
    _, premapped = np.unique(ranks, return_inverse=True)
    return rank_to_key(ranks), premapped.reshape(ranks.shape).astype(np.int32)


def _keep(folder, **arrays):
    """Writes `arrays` into `folder` whole or not at all (a staging folder renamed), so that runs side
    by side never read a half-written file."""
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(folder))
    for name, array in arrays.items():
        np.save(os.path.join(staging, f"{name}.npy"), array)
    try:
        os.rename(staging, folder)
    except OSError:  # another process kept the same data meanwhile
        import shutil

        shutil.rmtree(staging, ignore_errors=True)


def batch_dataset(keys, rows):
    """The batches, cycled, as a tf.data dataset of {"ids", "rows", "ts"}. The arrays stay in numpy: as
    graph constants (from_tensor_slices) they cost every process seconds of graph building and
    session start-up (measured: 7 s of a 16 s start-up). The one-batch prefetch serves every peer
    alike."""
    import tensorflow as tf

    def batch_at(i):
        return keys[i % len(keys)], rows[i % len(keys)]

    def element(i):
        ids, rows_ = tf.numpy_function(batch_at, [i], [tf.int64, tf.int32], stateful=False)
        # "ts": the step number as the data's timestamp (seconds), for peers that evict by age.
        return {"ids": tf.ensure_shape(ids, keys.shape[1:]), "rows": tf.ensure_shape(rows_, rows.shape[1:]),
                "ts": tf.fill(keys.shape[1:2], i)}

    return tf.data.Dataset.range(2**62).map(element).prefetch(1)


def distinct_per_batch(keys):
    """The median number of distinct ids in one batch."""
    return int(np.median([len(np.unique(b)) for b in keys]))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _packed_varints(values):
    """values [n, f] of non-negative ints: (every value's varint bytes, row by row, as one bytes
    object; each row's byte count)."""
    v = np.ascontiguousarray(values, np.int64)
    if v.size and v.min() < 0:
        raise ValueError("the records' fast path encodes non-negative ids only")
    u = v.astype(np.uint64)
    sizes = np.ones(u.shape, np.int64)
    rest = u >> np.uint64(7)
    while rest.any():
        sizes += rest > 0
        rest >>= np.uint64(7)
    width = int(sizes.max()) if sizes.size else 1
    out = np.empty(u.shape + (width,), np.uint8)
    for k in range(width):
        low = ((u >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        out[..., k] = low | ((k < sizes - 1).astype(np.uint8) << 7)
    return out[np.arange(width) < sizes[..., None]].tobytes(), sizes.sum(axis=1)


def serialized_examples(features):
    """tf.train.Example bytes, one per sample, of int64 features {name: [samples, f]} (non-negative),
    as TensorFlow's serializer writes them (checked against it in tests/test_bench_smoke.py), encoded
    with numpy: a Python Example object per sample cost 44 us, most of writing the records."""
    names = sorted(features)
    encoded = [_packed_varints(features[n]) for n in names]
    starts = [np.concatenate([[0], np.cumsum(sizes)]) for _, sizes in encoded]
    heads = {n: b"\x0a" + _varint(len(n)) + n.encode() for n in names}
    out = []
    for i in range(len(features[names[0]])):
        entries = []
        for n, (data, _), at in zip(names, encoded, starts):
            payload = data[at[i]:at[i + 1]]
            int64_list = b"\x0a" + _varint(len(payload)) + payload
            feature = b"\x1a" + _varint(len(int64_list)) + int64_list
            entry = heads[n] + b"\x12" + _varint(len(feature)) + feature
            entries.append(b"\x0a" + _varint(len(entry)) + entry)
        body = b"".join(entries)
        out.append(b"\x0a" + _varint(len(body)) + body)
    return out


def _written_once(keys, rows, seed, kind, files, write_file, layout=""):
    """The batches written as `files` files into a folder under the temporary directory named by
    the data's digest and `layout` (write_file(path, samples) writes one: {"ids", "rows": [samples,
    fields]}), once: later runs reuse them. Returns the files in reading order."""
    digest = hashlib.sha256(keys.data)
    digest.update(rows.data)
    digest.update(layout.encode())
    folder = os.path.join(tempfile.gettempdir(), f"shardrec-bench-{kind}", f"{digest.hexdigest()[:16]}-{seed}")
    names = [os.path.join(folder, f"part-{i}.{kind}") for i in range(files)]
    if all(os.path.exists(n) for n in names):
        return names
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(folder))
    per_file = -(-len(keys) // files)
    for i in range(files):
        batches = slice(i * per_file, min(len(keys), (i + 1) * per_file))
        write_file(os.path.join(staging, os.path.basename(names[i])),
                   {"ids": keys[batches].reshape(-1, keys.shape[-1]), "rows": rows[batches].reshape(-1, rows.shape[-1])})
    try:
        os.rename(staging, folder)
    except OSError:  # another process wrote the same data meanwhile
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return names


def write_records(keys, rows, seed, files=4):
    """The batches as TFRecord files of tf.train.Example, one per sample ({"ids", "rows": the
    sample's ids and pre-mapped rows}); written once, reused by later runs. Returns the files in
    reading order."""
    import tensorflow as tf

    def write_file(path, samples):
        with tf.io.TFRecordWriter(path) as writer:
            for record in serialized_examples(samples):
                writer.write(record)

    return _written_once(keys, rows, seed, "tfrecord", files, write_file)


def record_dataset(files, batch, fields, features):
    """A user's input path: the records, cycled, batched and parsed ({name: [batch, fields]} for
    `features` of "ids" and "rows", "rows" as int32), with the one-batch prefetch every peer gets.
    "ts" among `features`: each sample's timestamp, the step number (as batch_dataset's)."""
    import tensorflow as tf

    spec = {k: tf.io.FixedLenFeature([fields], tf.int64) for k in ("ids", "rows") if k in features}

    def parse(step, serialized):
        parsed = tf.io.parse_example(serialized, spec)
        if "rows" in parsed:
            parsed["rows"] = tf.cast(parsed["rows"], tf.int32)
        if "ts" in features:
            parsed["ts"] = tf.fill([batch], step)
        return parsed

    dataset = tf.data.TFRecordDataset(files).repeat().batch(batch, drop_remainder=True).enumerate()
    return dataset.map(parse).prefetch(1)


def write_parquet(keys, rows, seed, files=4, row_group_rows=16384):
    """The same samples as write_records, as Parquet files laid out as a training reader wants them
    (and as Criteo's data is): a scalar column a field ("ids_0".."ids_<F-1>", "rows_0"..), plain
    encoding, no compression; row groups of `row_group_rows`. Decoding a list column's repetition
    levels, a dictionary or Snappy costs more CPU per id than the whole feed otherwise does
    (bench/README.md). Written once beside the records; returns the files in reading order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def write_file(path, samples):
        arrays = {f"{name}_{f}": pa.array(np.ascontiguousarray(a[:, f])) for name, a in samples.items()
                  for f in range(a.shape[1])}
        # Required columns: no definition levels to decode.
        table = pa.table(arrays, schema=pa.schema([pa.field(n, a.type, nullable=False) for n, a in arrays.items()]))
        pq.write_table(table, path, row_group_size=row_group_rows, use_dictionary=False, compression="none")

    return _written_once(keys, rows, seed, "parquet", files, write_file, layout=f"required, {row_group_rows} rows")


def parquet_dataset(files, batch, fields, features, shardrec_training):
    """The Parquet feed: ParquetDataset over the files (epochs without end, as the records cycle),
    {name: [batch, fields]} for `features` of "ids" and "rows" ("rows" as int32; the fields' columns
    stacked by the reader: the feed's one copy), "ts" the step number; with the one-batch prefetch every peer gets.
    shardrec_training: read as shardrec's training dataset (its rank's share, positions kept), else
    as a plain reader of every file."""
    import tensorflow as tf
    from shardrec.rank_runtime import ParquetDataset

    wanted = [k for k in ("ids", "rows") if k in features]
    columns = {k: ("id", [f"{k}_{f}" for f in range(fields)]) for k in wanted}
    reader = dict(training=True) if shardrec_training else dict(training=False, shard=(0, 1))
    dataset = ParquetDataset(files, batch, columns, num_epochs=1 << 20, **reader).enumerate()

    def adapt(step, parsed):
        if "rows" in parsed:
            parsed["rows"] = tf.cast(parsed["rows"], tf.int32)
        if "ts" in features:
            parsed["ts"] = tf.fill([batch], step)
        return parsed

    return dataset.map(adapt).prefetch(1)
