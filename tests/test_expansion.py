"""Dynamic expansion on the native row store: tables that grow a chunk at a time, the memory limit,
the by-address optimizers and their graph collections, checkpoints of grown tables.

The oracle of the 2-rank runs is a table of fixed size with room for every key, trained on the
same data (constant initializer: every mode must end with the same rows); of the single-rank
checks, numpy and the row store's own contents."""
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

from mpi_helpers import JOBS, check, mpiexec
from pipeline_helpers import FeatureSpec, batched_iterator, run_all
from shardrec.rank_runtime.process import lifecycle
from shardrec.rank_runtime import create_table, get_dense_and_sparse_variable, sparse_lookup, start_asc_pipeline

sys.path.insert(0, JOBS)
import expansion_train  # noqa: E402

MODES = ("fixed", "expand", "by_address")
DIM = 8


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("expansion")
    for mode in MODES:
        check(mpiexec(2, "expansion_train.py", out, mode, timeout=600))
    return {mode: [dict(np.load(out / f"{mode}-rank{r}.npz")) for r in range(2)] for mode in MODES}


def _rows_by_key(parts):
    keys = np.concatenate([p["keys"] for p in parts])
    order = np.argsort(keys)
    return keys[order], np.concatenate([p["values"] for p in parts])[order]


@pytest.mark.parametrize("mode", ["expand", "by_address"])
def test_grown_table_trains_like_a_large_fixed_table(two_rank_runs, mode):
    fixed_keys, fixed_rows = _rows_by_key(two_rank_runs["fixed"])
    keys, rows = _rows_by_key(two_rank_runs[mode])
    assert len(keys) == expansion_train.DISTINCT == len(np.unique(expansion_train.global_ids()))
    np.testing.assert_array_equal(keys, fixed_keys)
    assert np.abs(fixed_rows - 0.1).max() > 1e-2, "training moved the rows"
    np.testing.assert_allclose(rows, fixed_rows, atol=1e-5, rtol=0)
    for r, part in enumerate(two_rank_runs[mode]):
        slots = [k for k in part if k.endswith((".m", ".v"))]
        assert len(slots) == 2, slots
        fixed = dict(zip(two_rank_runs["fixed"][r]["keys"].tolist(), two_rank_runs["fixed"][r]["LazyAdam.m"]))
        np.testing.assert_allclose(part[slots[0]], np.array([fixed[k] for k in part["keys"].tolist()]), atol=1e-6)


@pytest.mark.parametrize("mode", ["expand", "by_address"])
def test_capacity_grows_with_the_keys_and_memory_with_the_rows_in_use(two_rank_runs, mode):
    for part in two_rank_runs[mode]:
        caps = part["capacities"]
        held = len(part["keys"])
        # Room for 1,000 keys per rank at creation; a chunk (4,096 rows) at a time from there.
        assert caps[0] <= 8192 and caps[-1] >= held > 90_000
        assert np.all(np.diff(caps) >= 0) and caps[-1] - held < 4096
        assert part["max_rows"] > 100 * caps[-1], "the limit is far above what is in use"
        values, slots, metadata = part["counters"]
        assert values == caps[-1] * DIM * 4 and slots == 2 * values and metadata == caps[-1] * 13  # count, last-seen timestamp, changed byte
        # Resident memory follows the rows in use (about 11 MB of rows here), not the reservation
        # (the limit: GBs of address space per column).
        grown = part["rss_end"] - part["rss_start"]
        assert grown < 120 * 2**20, grown
        assert grown < part["max_rows"] * DIM * 4 / 50


def test_memory_limit_stops_every_rank_naming_table_limit_and_way_out(tmp_path):
    proc = mpiexec(2, "expansion_train.py", tmp_path, "expand", env={"SHARDREC_TABLE_MEMORY_LIMIT": "1M"}, timeout=300)
    assert proc.returncode != 0
    for rank in range(2):
        path = tmp_path / f"expand-rank{rank}.error"
        assert path.exists(), proc.stderr[-4000:]
        assert re.search(r"table 'emb' reached its memory limit of 1048576 bytes on rank \d \(\d+ rows in use.*"
                         r"raise SHARDREC_TABLE_MEMORY_LIMIT", path.read_text()), path.read_text()


def _train_one_rank(expands, make_optimizer, data, initializer, batch=64, by_address=False, init_param=1.0):
    lifecycle.init(use_dynamic_expansion=expands)
    spec = FeatureSpec("ids", table_name="emb")
    iterator, element = batched_iterator(data, batch, [spec])
    table = create_table(tf.int64, DIM, "emb", initializer, device_vocabulary_size=10 if expands else 50_000,
                         init_param=init_param)
    emb = sparse_lookup(table, spec, batch=element)
    loss = tf.reduce_mean(tf.square(tf.reduce_sum(emb, axis=[1, 2]) - element["y"]))
    if by_address:
        from shardrec.rank_runtime.optimizers.by_address import ASCEND_SPARSE_LOOKUP_ID_OFFSET, ASCEND_SPARSE_LOOKUP_LOCAL_EMB

        local = tf.compat.v1.get_collection(ASCEND_SPARSE_LOOKUP_LOCAL_EMB)
        addresses = tf.compat.v1.get_collection(ASCEND_SPARSE_LOOKUP_ID_OFFSET)
        train = make_optimizer().apply_gradients(zip(tf.gradients(loss, local), addresses))
    else:
        _, sparse = get_dense_and_sparse_variable()
        train = make_optimizer().apply_gradients(zip(tf.gradients(loss, sparse), sparse))
    start_asc_pipeline()
    return table, iterator, train, element


def _data(n=640, pool=3000, seed=1):
    rng = np.random.default_rng(seed)
    return {"ids": rng.integers(-pool, pool, size=(n, 2)).astype(np.int64), "y": rng.normal(size=n).astype(np.float32)}


@pytest.mark.parametrize("initializer,check", [
    (tf.compat.v1.random_uniform_initializer(-0.5, 0.25, seed=3), lambda v: v.min() >= -1.0 and v.max() < 0.5),
    (tf.compat.v1.truncated_normal_initializer(0.0, 0.1, seed=3), lambda v: np.abs(v).max() <= 0.4 + 1e-6),
    (tf.compat.v1.random_normal_initializer(1.0, 0.1, seed=3), lambda v: abs(v.mean() - 2.0) < 0.02),
])
def test_new_rows_are_drawn_from_the_initializers_distribution_times_init_param(graph, initializer, check):
    from mx_rec.optimizers.gradient_descent import create_hash_optimizer

    # A learning rate of 0: the rows keep the values they were drawn with.
    table, iterator, train, _ = _train_one_rank(True, lambda: create_hash_optimizer(0.0), _data(), initializer,
                                                init_param=2.0)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        run_all(sess, iterator, train)
        values = table.export(sess)["values"]
    assert len(values) > 1000 and check(values)
    assert len(np.unique(values[:, 0])) > 0.9 * len(values), "every row draws its own values"


def test_an_initializer_without_a_native_draw_is_refused_with_expansion(runtime):
    lifecycle.terminate_config_initializer()
    lifecycle.init(use_dynamic_expansion=True)
    with pytest.raises(ValueError, match=r"create_table\('t'\): with dynamic expansion.*truncated_normal.*Glorot"):
        create_table(tf.int64, 4, "t", tf.compat.v1.glorot_uniform_initializer())


@pytest.mark.parametrize("text", ["abc", "0", "12Q", "-5"])
def test_bad_memory_limit_setting_is_named(runtime, monkeypatch, text):
    lifecycle.terminate_config_initializer()
    lifecycle.init(use_dynamic_expansion=True)
    monkeypatch.setenv("SHARDREC_TABLE_MEMORY_LIMIT", text)
    with pytest.raises(ValueError, match=r"SHARDREC_TABLE_MEMORY_LIMIT=.*not a memory size; allowed: a positive"):
        create_table(tf.int64, 4, "t", tf.compat.v1.zeros_initializer())


def test_collections_hold_local_rows_and_addresses_of_the_batch_keys(graph):
    from mx_rec.optimizers.lazy_adam_by_addr import create_hash_optimizer_by_address

    data = _data(64)
    table, iterator, train, element = _train_one_rank(True, lambda: create_hash_optimizer_by_address(0.01), data,
                                                      tf.compat.v1.constant_initializer(0.5), by_address=True)
    from shardrec.rank_runtime.optimizers.by_address import ASCEND_SPARSE_LOOKUP_ID_OFFSET, ASCEND_SPARSE_LOOKUP_LOCAL_EMB

    (local,), (addresses,) = (tf.compat.v1.get_collection(c) for c in (ASCEND_SPARSE_LOOKUP_LOCAL_EMB,
                                                                      ASCEND_SPARSE_LOOKUP_ID_OFFSET))
    assert addresses.dtype == tf.int64 and local.shape[-1] == DIM
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(iterator.initializer)
        ids, got_local, got_addresses = sess.run([element["ids"], local, addresses])
    # The addresses are the rows of the batch's distinct keys in the row store, each once.
    expected = table.index.lookup(np.unique(ids), allocate=False)
    assert sorted(got_addresses.tolist()) == sorted(expected.tolist())
    np.testing.assert_array_equal(got_local, np.full((len(expected), DIM), 0.5, np.float32))


def test_sgd_by_address_applies_its_weight_decay(graph):
    from mx_rec.optimizers.gradient_descent_by_addr import create_hash_optimizer_by_addr

    lr, decay = 0.1, 0.05
    data = {"ids": np.array([[7, 9]], np.int64), "y": np.array([3.0], np.float32)}
    table, iterator, train, _ = _train_one_rank(True, lambda: create_hash_optimizer_by_addr(lr, weight_decay=decay),
                                                data, tf.compat.v1.constant_initializer(0.5), batch=1, by_address=True)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        run_all(sess, iterator, train)
        values = table.export(sess)["values"]
    # loss = (sum of 16 values of 0.5 - 3)^2: d/d(value) = 2 * (8 - 3) = 10 for every value.
    np.testing.assert_allclose(values, 0.5 - lr * (10 + decay * 0.5), atol=1e-6)


def test_by_address_optimizers_refuse_a_run_without_expansion(runtime):
    from mx_rec.optimizers.adagrad_by_addr import create_hash_optimizer_by_address as adagrad
    from mx_rec.optimizers.gradient_descent_by_addr import create_hash_optimizer_by_addr as sgd
    from mx_rec.optimizers.lazy_adam_by_addr import create_hash_optimizer_by_address as adam

    for make in (lambda: adam(), lambda: adagrad(), lambda: sgd(0.1)):
        with pytest.raises(ValueError, match=r"by-address optimizers need dynamic capacity expansion "
                                             r"\(init\(use_dynamic_expansion=True\)\)"):
            make()


def test_by_address_apply_refuses_what_is_not_an_address(graph):
    from mx_rec.optimizers.lazy_adam_by_addr import create_hash_optimizer_by_address

    lifecycle.init(use_dynamic_expansion=True)
    opt = create_hash_optimizer_by_address()
    with pytest.raises(TypeError, match="is not an address tensor of a lookup"):
        opt.apply_gradients([(tf.zeros([2, 4]), tf.constant([0, 1], tf.int64))])
    with pytest.raises(ValueError, match=r"beta1"):
        create_hash_optimizer_by_address(beta1=1.0)


def _save_and_restore(tmp_path, expands_at_save, expands_at_restore):
    from mx_rec.optimizers.lazy_adam import create_hash_optimizer

    data = _data(n=6400, pool=20_000)
    with tf.Graph().as_default():
        table, iterator, train, _ = _train_one_rank(expands_at_save, lambda: create_hash_optimizer(0.05), data,
                                                    tf.compat.v1.truncated_normal_initializer(stddev=0.1, seed=2))
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            run_all(sess, iterator, train)
            saved = table.export(sess)
            path = saver.save(sess, str(tmp_path / "model"), global_step=10)
        lifecycle.terminate_config_initializer()
    with tf.Graph().as_default():
        table, *_ = _train_one_rank(expands_at_restore, lambda: create_hash_optimizer(0.05), data,
                                    tf.compat.v1.zeros_initializer())
        with tf.compat.v1.Session() as sess:
            tf.compat.v1.train.Saver().restore(sess, path)
            restored = table.export(sess)
            capacity = table.capacity()
        lifecycle.terminate_config_initializer()
    return saved, restored, capacity


@pytest.mark.parametrize("at_save,at_restore", [(True, True), (True, False), (False, True)])
def test_checkpoints_of_grown_tables_restore_into_either_kind(tmp_path, at_save, at_restore):
    saved, restored, capacity = _save_and_restore(tmp_path, at_save, at_restore)
    assert len(saved["keys"]) > 4096, "the saved table grew past its first chunk"
    order_s, order_r = np.argsort(saved["keys"]), np.argsort(restored["keys"])
    np.testing.assert_array_equal(saved["keys"][order_s], restored["keys"][order_r])
    for name in ("values", "LazyAdam.m", "LazyAdam.v"):
        np.testing.assert_array_equal(saved[name][order_s], restored[name][order_r])
    assert capacity >= len(saved["keys"])


def test_a_bind_of_a_store_not_in_this_process_is_an_error(graph):
    from shardrec.rank_runtime.embedding import native_ops

    var = tf.compat.v1.Variable(tf.zeros([2, 2]), use_resource=True)
    bind = native_ops.load().shardrec_store_bind(var.handle, tf.zeros([0, 2]), store=12345678, column=0)
    with tf.compat.v1.Session() as sess:
        with pytest.raises(tf.errors.FailedPreconditionError, match="row store is not in this process"):
            sess.run(bind)


def test_a_restore_over_the_memory_limit_is_refused_before_anything_is_loaded(tmp_path, monkeypatch):
    from mx_rec.optimizers.lazy_adam import create_hash_optimizer

    saved, _, _ = _save_and_restore(tmp_path, True, True)
    path = str(tmp_path / "model-10")
    monkeypatch.setenv("SHARDREC_TABLE_MEMORY_LIMIT", "64K")
    with tf.Graph().as_default():
        table, *_ = _train_one_rank(True, lambda: create_hash_optimizer(0.05), _data(), tf.compat.v1.zeros_initializer())
        with tf.compat.v1.Session() as sess:
            with pytest.raises(Exception, match=rf"table 'emb' has {len(saved['keys'])} keys for rank 0: \d+ bytes of "
                                                r"rows, over its memory limit of 65536 bytes; raise "
                                                r"SHARDREC_TABLE_MEMORY_LIMIT"):
                tf.compat.v1.train.Saver().restore(sess, path)
            assert table.size() == 0, "nothing was loaded"
        lifecycle.terminate_config_initializer()


def test_a_grown_table_exports_every_row_for_serving(tmp_path):
    """A table grown by expansion past its first chunk, exported from its checkpoint and served
    by a process without shardrec: each key reads its saved row, an unseen key zeros."""
    from serving_helpers import serve

    from shardrec.rank_runtime import export_saved_model

    saved, _, _ = _save_and_restore(tmp_path, True, True)
    assert len(saved["keys"]) > 4096

    def outputs(features):
        table = create_table(tf.int64, DIM, "emb", tf.compat.v1.zeros_initializer())
        return {"emb": sparse_lookup(table, FeatureSpec("ids", table_name="emb"), batch=features)}

    export_saved_model(str(tmp_path / "model-10"), str(tmp_path / "export"), outputs,
                       {"ids": tf.TensorSpec([None], tf.int64)})
    ids = np.append(saved["keys"], 2**50)
    emb = serve(tmp_path / "export", {"ids": ids}, tmp_path)["emb"]
    np.testing.assert_array_equal(emb[:-1], saved["values"])
    np.testing.assert_array_equal(emb[-1], np.zeros(DIM, np.float32))
