"""Graph-modification mode against FeatureSpec mode (the oracle) under real mpiexec, and its errors."""
import os

import numpy as np
import pytest
import tensorflow as tf

from mpi_helpers import check, mpiexec


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for n, kind in ((1, "initializable"), (2, "initializable"), (2, "one_shot")):
        d = tmp_path_factory.mktemp(f"gm{n}{kind}")
        check(mpiexec(n, "graph_mod_oracle.py", d, kind, timeout=240, cwd=d))
        out[(n, kind)] = d
    return out


def _load(directory, tag, rank, n):
    return np.load(os.path.join(directory, f"{tag}-rank{rank}-of{n}.npz"))


def _rows_by_key(run, table):
    return dict(zip(run[f"{table}_keys"].tolist(), run[f"{table}_rows"]))


@pytest.mark.parametrize("n,kind", [(1, "initializable"), (2, "initializable"), (2, "one_shot")])
def test_graph_modification_trains_exactly_like_feature_spec_mode(runs, n, kind):
    suffix = "-oneshot" if kind == "one_shot" else ""
    for rank in range(n):
        spec = _load(runs[(n, kind)], "spec" + suffix, rank, n)
        mod = _load(runs[(n, kind)], "modify" + suffix, rank, n)
        assert len(spec["losses"]) == 30, "every batch was trained"
        np.testing.assert_allclose(mod["losses"], spec["losses"], atol=1e-5)
        np.testing.assert_allclose(mod["preds"], spec["preds"], atol=1e-5)
        for table in ("deep", "wide"):
            want, got = _rows_by_key(spec, table), _rows_by_key(mod, table)
            assert set(got) == set(want), f"{table}: rank {rank} holds other keys"
            for key, row in want.items():
                np.testing.assert_allclose(got[key], row, atol=1e-5)


def test_two_ranks_reproduce_one_rank_in_graph_modification_mode(runs):
    one = _load(runs[(1, "initializable")], "modify", 0, 1)
    merged = {}
    for rank in range(2):
        merged.update(_rows_by_key(_load(runs[(2, "initializable")], "modify", rank, 2), "deep"))
    single = _rows_by_key(one, "deep")
    assert set(merged) == set(single)
    for key, row in single.items():
        np.testing.assert_allclose(merged[key], row, atol=1e-5)


def test_dump_graph_writes_readable_graphs_before_and_after(runs):
    # The job asks for the dump on rank 0 and runs in its output directory.
    directory = os.path.join(runs[(2, "initializable")], "graph_dump", "rank-0")
    before = open(os.path.join(directory, "before_modify.pbtxt")).read()
    after = open(os.path.join(directory, "after_modify.pbtxt")).read()
    assert 'op: "IteratorGetNext"' in before and "shardrec_key_exchange" not in before
    assert "shardrec_key_exchange" in after and "shardrec_modified_input" in after
    assert not os.path.exists(os.path.join(runs[(2, "initializable")], "graph_dump", "rank-1"))


def _iterator_batch():
    data = {"ids": np.arange(12, dtype=np.int64).reshape(6, 2)}
    iterator = tf.compat.v1.data.make_initializable_iterator(tf.data.Dataset.from_tensor_slices(data).batch(3))
    return iterator, iterator.get_next()


def _table(name="t"):
    from shardrec.rank_runtime import create_table

    return create_table(tf.int64, 4, name, tf.compat.v1.zeros_initializer(), device_vocabulary_size=100)


def test_ids_not_from_an_iterator_name_the_lookup_and_what_was_found(runtime):
    from shardrec.rank_runtime import sparse_lookup

    ids = tf.compat.v1.placeholder(tf.int64, [None, 2], name="user_ids")
    with pytest.raises(ValueError, match=r"'my_lookup'.*Placeholder op 'user_ids'"):
        sparse_lookup(_table(), ids, modify_graph=True, name="my_lookup")
    with pytest.raises(ValueError, match=r"'const_lookup'.*do not come from a dataset iterator.*Const op"):
        sparse_lookup(_table("t2"), tf.constant([[1, 2]], tf.int64), modify_graph=True, name="const_lookup")
    var = tf.compat.v1.get_variable("v", [2, 2], tf.int64, use_resource=True)
    with pytest.raises(ValueError, match=r"'var_lookup'.*ReadVariableOp"):
        sparse_lookup(_table("t3"), var.read_value() + 1, modify_graph=True, name="var_lookup")
    with pytest.raises(TypeError, match="ids must be int32 or int64"):
        sparse_lookup(_table("t4"), tf.cast(_iterator_batch()[1]["ids"], tf.float32), modify_graph=True)


def test_get_initializer_before_modification_and_modification_without_lookups_are_refused(runtime):
    from shardrec.rank_runtime.pipeline.graph_modifier import get_initializer, modify_graph_and_start_emb_cache

    with pytest.raises(RuntimeError, match="not modified yet.*modify_graph_and_start_emb_cache"):
        get_initializer(True)
    with pytest.raises(RuntimeError, match="no sparse_lookup\\(..., modify_graph=True\\)"):
        modify_graph_and_start_emb_cache()
    with pytest.raises(TypeError, match="'is_training' must be a bool"):
        get_initializer("train")


def test_train_and_eval_lookups_on_one_iterator_are_refused(runtime):
    from shardrec.rank_runtime import sparse_lookup
    from shardrec.rank_runtime.pipeline.graph_modifier import modify_graph_and_start_emb_cache

    _, batch = _iterator_batch()
    table = _table()
    sparse_lookup(table, batch["ids"], modify_graph=True, is_train=True, name="a")
    sparse_lookup(table, batch["ids"], modify_graph=True, is_train=False, name="b")
    with pytest.raises(ValueError, match="is_train=True and is_train=False.*own iterators"):
        modify_graph_and_start_emb_cache()


def test_modified_lookup_returns_the_ids_shape(runtime):
    from shardrec.rank_runtime import sparse_lookup

    _, batch = _iterator_batch()
    emb = sparse_lookup(_table(), tf.reshape(batch["ids"], [-1, 2, 1]), modify_graph=True)
    assert emb.shape.as_list() == [None, 2, 1, 4]
