"""16-bit rows: create_table(value_dtype=tf.float16 / tf.bfloat16, slot_dtype=tf.bfloat16).

Oracles: numpy's float16 and ml_dtypes' bfloat16 for the conversions (the ones TensorFlow's casts
use); for training, TensorFlow computing the same model's gradients and numpy the optimizers' float32
arithmetic on rows held in 16 bits, each written back to the nearest; for stochastic rounding, the
expected value of many updates smaller than half a 16-bit step (which rounding to the nearest loses).
"""
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf
from ml_dtypes import bfloat16

from mpi_helpers import JOBS, check, mpiexec

sys.path.insert(0, JOBS)
import oracle_train  # noqa: E402

NUMPY = {"float16": np.float16, "bfloat16": bfloat16}
# The spacing of 16-bit numbers just above 1.0.
STEP_ABOVE_ONE = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


@pytest.fixture(scope="module")
def oracle_runs(tmp_path_factory):
    out = {}
    for n, dtype in ((1, "float16"), (2, "float16"), (2, "bfloat16")):
        d = tmp_path_factory.mktemp(f"rows16-{n}-{dtype}")
        check(mpiexec(n, "oracle_train.py", d, "div", dtype, timeout=300))
        out[n, dtype] = d
    return out


def tensorflow_oracle(opt, dtype):
    """oracle_train's model on one process: TensorFlow's gradients, numpy's float32 updates of rows
    held in `dtype` and written back to the nearest 16-bit number (lazy Adam's moments float32)."""
    batch, fields, dim, dense = oracle_train.GLOBAL_BATCH, oracle_train.FIELDS, oracle_train.DIM, oracle_train.DENSE
    data = oracle_train.global_data()
    keys, inverse = np.unique(data["ids"], return_inverse=True)
    rows_of = inverse.reshape(data["ids"].shape)
    narrow = NUMPY[dtype]
    table = np.full([len(keys), dim], 0.1, np.float32).astype(narrow)
    m = np.zeros([len(keys), dim], np.float32)
    v = np.zeros([len(keys), dim], np.float32)
    f32 = np.float32
    b1, b2, eps, b1_power, b2_power = f32(0.9), f32(0.999), f32(1e-8), f32(0.9), f32(0.999)
    with tf.Graph().as_default():
        w_init = tf.compat.v1.get_variable("w", [fields * dim + dense, 1],
                                           initializer=tf.compat.v1.glorot_uniform_initializer(seed=7))
        e = tf.compat.v1.placeholder(tf.float32, [batch, fields, dim])
        x = tf.compat.v1.placeholder(tf.float32, [batch, dense])
        y = tf.compat.v1.placeholder(tf.float32, [batch])
        w = tf.compat.v1.placeholder(tf.float32, [fields * dim + dense, 1])
        pred = tf.squeeze(tf.matmul(tf.concat([tf.reshape(e, [-1, fields * dim]), x], 1), w), 1)
        loss = tf.reduce_mean(tf.square(pred - y))
        grads = tf.gradients(loss, [e, w])
        with tf.compat.v1.Session() as sess:
            sess.run(w_init.initializer)
            w_value = sess.run(w_init)
            for s in range(oracle_train.STEPS):
                at = slice(s * batch, (s + 1) * batch)
                rows = rows_of[at]
                g_e, g_w = sess.run(grads, {e: table.astype(np.float32)[rows], x: data["x"][at], y: data["y"][at],
                                            w: w_value})
                g = np.zeros([len(keys), dim], np.float32)
                np.add.at(g, rows.reshape(-1), g_e.reshape(-1, dim))  # in position order, as the kernels sum
                seen = np.unique(rows)
                old = table[seen].astype(np.float32)
                if opt == "sgd":
                    new = old - f32(0.1) * g[seen]
                else:
                    lr = f32(0.02) * np.sqrt(f32(1) - b2_power) / (f32(1) - b1_power)
                    m[seen] = b1 * m[seen] + (f32(1) - b1) * g[seen]
                    v[seen] = b2 * v[seen] + (f32(1) - b2) * (g[seen] * g[seen])
                    new = old - lr * m[seen] / (np.sqrt(v[seen]) + eps)
                    b1_power, b2_power = b1_power * b1, b2_power * b2
                table[seen] = new.astype(narrow)
                w_value = w_value - f32(0.05) * g_w
    return dict(zip(keys.tolist(), table.astype(np.float32))), w_value


def _parts(directory, opt, n):
    return [np.load(os.path.join(directory, f"div-{opt}-rank{r}-of{n}.npz")) for r in range(n)]


@pytest.mark.parametrize("opt", ["sgd", "lazy_adam"])
@pytest.mark.parametrize("n,dtype", [(1, "float16"), (2, "float16"), (2, "bfloat16")])
def test_16_bit_rows_train_as_float32_arithmetic_rounded_to_the_nearest(oracle_runs, opt, n, dtype):
    """Rounding turned off (stochastic_rounding=False): every row equals the oracle's to its 16-bit
    precision after 40 steps; on one rank, where the gradients are summed in the oracle's order,
    bit for bit."""
    ref, w = tensorflow_oracle(opt, dtype)
    assert max(np.abs(r - 0.1).max() for r in ref.values()) > 0.05, "training moved the rows"
    rows = {}
    for part in _parts(oracle_runs[n, dtype], opt, n):
        assert int(part["steps"]) == oracle_train.STEPS
        np.testing.assert_allclose(part["w"], w, atol=1e-5, rtol=0)
        rows.update(zip(part["keys"].tolist(), part["rows"]))
    assert rows.keys() == ref.keys()
    got, want = np.stack([rows[k] for k in ref]), np.stack(list(ref.values()))
    assert np.array_equal(got, got.astype(NUMPY[dtype]).astype(np.float32)), "rows hold 16-bit numbers"
    spacing = STEP_ABOVE_ONE[dtype] * np.maximum(np.abs(want), 2.0**-14)
    assert (np.abs(got - want) <= spacing).all(), np.abs(got - want).max()
    exact = (got == want).mean()
    assert exact >= (1.0 if n == 1 else 0.95), f"{exact:.3f} of the numbers are the oracle's"


def test_the_table_counters_report_the_bytes_of_a_16_bit_row(oracle_runs):
    """values 2 bytes a number, lazy Adam's slots float32, 13 bytes of metadata (count, last seen, changed)."""
    dim = oracle_train.DIM
    [sgd] = _parts(oracle_runs[1, "float16"], "sgd", 1)
    [adam] = _parts(oracle_runs[1, "float16"], "lazy_adam", 1)
    assert int(sgd["bytes_per_row"]) == 2 * dim + 13
    assert int(adam["bytes_per_row"]) == 2 * dim + 2 * 4 * dim + 13


@pytest.mark.parametrize("fmt,dtype", [(1, "float16"), (2, "bfloat16")])
def test_rows_go_to_the_nearest_16_bit_number_and_back_exactly(fmt, dtype):
    from shardrec.native import core

    dim = 64
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((256, dim)) * np.exp(rng.uniform(-25, 12, (256, 1)))).astype(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519, 65520, -65536, 1e-8, -3e-8, 6.1e-5,
                        5.9604645e-08, 2.9802322e-08, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 3.4e38, 1e-40], np.float32)
    values[0, :len(special)] = special
    store = core.RowStore("t", dim, 257, 0, 0, 0.0, 0.0, 0, 1.0, fmt)
    index = core.EmbeddingIndex("t", 256, store)
    rows = index.lookup(np.arange(256, dtype=np.int64), allocate=True)
    store.write_rows(0, rows, values)
    back = store.read_rows(0, rows)
    with np.errstate(over="ignore"):  # beyond float16's range: infinity, as the store rounds it
        want = values.astype(NUMPY[dtype]).astype(np.float32)
    np.testing.assert_array_equal(back, want)  # nan where numpy has nan
    assert np.array_equal(np.signbit(back), np.signbit(want))
    assert store.column_dtype(0) == {"float16": "<f2", "bfloat16": "bfloat16"}[dtype]
    assert store.bytes().values == store.in_use * dim * 2


def _sgd_below_half_a_step(dtype, seeds, rows=2000, dim=8):
    """A 16-bit variable of ones and an SGD update per seed, of a tenth to a fifth of its spacing
    above 1.0 (row i: (1 + i / rows) tenths): returns the rows and what each row's updates add up to.
    The rounding's random numbers depend on the step and the number rounded, not on the row, so
    rows of equal values and gradients would round alike: the gradients differ by row."""
    from shardrec.rank_runtime.embedding import native_ops

    tiny = (STEP_ABOVE_ONE[dtype] / 10 * (1 + np.arange(rows) / rows)).astype(np.float32)
    grad = np.repeat(tiny[:, None], dim, 1)
    with tf.Graph().as_default():
        var = tf.compat.v1.get_variable("w", initializer=tf.ones([rows + 1, dim], tf.as_dtype(dtype)), use_resource=True)
        step = tf.compat.v1.placeholder(tf.int64, [])
        update = native_ops.load().shardrec_sparse_apply_sgd(var.handle, tf.range(rows), grad, 1.0, step)
        with tf.compat.v1.Session() as sess:
            sess.run(var.initializer)
            for s in seeds:
                sess.run(update, {step: s})
            return sess.run(var)[:rows].astype(np.float32), grad * len(seeds)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_stochastic_rounding_keeps_updates_smaller_than_half_a_step_on_average_and_is_reproducible(dtype):
    """Rounded to the nearest, 1 - 0.1 step is 1 again every time: the rows would never move. Rounded
    stochastically, they move by the updates' sum on average (each number by whole 16-bit steps)."""
    steps = list(range(100))
    rows, expected = _sgd_below_half_a_step(dtype, steps)
    moved = 1.0 - rows
    assert abs(moved.mean() - expected.mean()) < 0.02 * expected.mean(), (moved.mean(), expected.mean())
    assert len(np.unique(moved)) > 3  # numbers moved by different counts of steps
    again, _ = _sgd_below_half_a_step(dtype, steps)
    assert np.array_equal(rows, again), "the same steps round the same way"
    other, _ = _sgd_below_half_a_step(dtype, [s + 1000 for s in steps])
    assert not np.array_equal(rows, other), "other steps draw other numbers"


@pytest.fixture(scope="module")
def saved16(tmp_path_factory):
    """A float16 table with bfloat16 slots (lazy Adam), trained 10 steps on 2 ranks and saved."""
    d = tmp_path_factory.mktemp("ckpt16")
    check(mpiexec(2, "ckpt_job.py", "--out", d, "--tag", "src", "--start", 0, "--end", 10, "--save", d / "model",
                  "--value-dtype", "float16", "--slot-dtype", "bfloat16", timeout=240))
    return d


def _by_key(directory, tag, n, what):
    out = {}
    for r in range(n):
        part = np.load(os.path.join(directory, f"{tag}-rank{r}-of{n}.npz"))
        out.update(zip(part["emb.keys"].tolist(), part[f"emb.{what}"]))
    return out


def test_a_16_bit_table_saves_its_rows_as_it_holds_them(saved16):
    for rank in range(2):
        manifest = json.load(open(saved16 / "sparse-model-10" / f"rank-{rank}-of-2" / "MANIFEST.json"))
        files = manifest["tables"]["emb"]["files"]
        assert files["values"]["dtype"] == "<f2"
        assert {files[s]["dtype"] for s in ("LazyAdam.m", "LazyAdam.v")} == {"bfloat16"}
        assert manifest["tables"]["wide"]["files"]["values"]["dtype"] == "<f4"
        values = np.load(saved16 / "sparse-model-10" / f"rank-{rank}-of-2" / "emb" / "values.npy")
        assert values.dtype == np.float16


@pytest.mark.parametrize("value_dtype,slot_dtype", [("float16", "bfloat16"), ("float32", "float32")])
def test_a_16_bit_checkpoint_restores_exactly_or_converted_and_says_so(saved16, value_dtype, slot_dtype):
    """Into the same dtypes on 1 rank (resharded): bit for bit. Into float32: the same numbers, and
    the log names the conversion."""
    tag = f"into-{value_dtype}"
    proc = check(mpiexec(1, "ckpt_job.py", "--out", saved16, "--tag", tag, "--restore", saved16 / "model-10",
                         "--value-dtype", value_dtype, "--slot-dtype", slot_dtype, timeout=240))
    for what in ("values", "LazyAdam.m", "LazyAdam.v"):
        source, restored = _by_key(saved16, "src", 2, what), _by_key(saved16, tag, 1, what)
        assert source.keys() == restored.keys()
        for key, row in source.items():
            np.testing.assert_array_equal(restored[key], row, err_msg=f"{what} of key {key}")
    converted = "the checkpoint holds values as <f2, this job as <f4: converted on restore"
    assert (converted in proc.stderr) == (value_dtype == "float32"), proc.stderr[-3000:]


def test_a_float32_checkpoint_restores_into_16_bit_rows_to_the_nearest(saved16, tmp_path):
    check(mpiexec(1, "ckpt_job.py", "--out", tmp_path, "--tag", "f32", "--start", 0, "--end", 5, "--save",
                  tmp_path / "model", timeout=240))
    proc = check(mpiexec(1, "ckpt_job.py", "--out", tmp_path, "--tag", "into16", "--restore", tmp_path / "model-5",
                         "--value-dtype", "bfloat16", timeout=240))
    source, restored = _by_key(tmp_path, "f32", 1, "values"), _by_key(tmp_path, "into16", 1, "values")
    assert source.keys() == restored.keys()
    for key, row in source.items():
        np.testing.assert_array_equal(restored[key], row.astype(bfloat16).astype(np.float32))
    assert "the checkpoint holds values as <f4, this job as bfloat16: converted on restore" in proc.stderr


@pytest.mark.parametrize("row_dtype", ["float32", "float16"])
def test_the_export_serves_a_16_bit_table_s_rows_as_float32(saved16, tmp_path, row_dtype):
    """An export of the float16 table holds its rows as float32 or, when asked, float16: either way
    a lookup returns the checkpoint's numbers exactly, and zeros for a key without a row."""
    from shardrec.rank_runtime import create_table, export_saved_model, sparse_lookup

    def model(features):
        table = create_table(tf.int64, 4, "emb", tf.compat.v1.zeros_initializer())
        return {"emb": sparse_lookup(table, features["ids"])}

    source = _by_key(saved16, "src", 2, "values")
    keys = np.array(sorted(source)[:50] + [123456789], np.int64)
    out = tmp_path / "export"
    export_saved_model(str(saved16 / "model-10"), str(out), model, {"ids": tf.TensorSpec([None], tf.int64)},
                       row_dtype=row_dtype)
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        meta = tf.compat.v1.saved_model.loader.load(sess, [tf.saved_model.SERVING], str(out))
        sig = meta.signature_def["serving_default"]
        got = sess.run(sig.outputs["emb"].name, {sig.inputs["ids"].name: keys})
        held = [v for v in tf.compat.v1.global_variables() if v.op.name == "emb/values"]
        assert [v.dtype.base_dtype.name for v in held] == [row_dtype]
    np.testing.assert_array_equal(got, np.stack([source[k] for k in keys[:-1].tolist()] + [np.zeros(4, np.float32)]))
