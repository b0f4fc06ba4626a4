"""Rec SDK calls as the seed pages write them, parameters that have no effect here, and small
input defects: each either works as documented or says clearly what it does not do."""
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from pipeline_helpers import FeatureSpec, batched_iterator, run_all, slot_row_initializer
from shardrec.rank_runtime.process import lifecycle
from shardrec.rank_runtime import create_table, get_asc_insert_func, sparse_lookup, start_asc_pipeline


@pytest.fixture
def shardrec_warnings():
    """The warnings shardrec logs during the test (its logger does not propagate to pytest's)."""
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("shardrec")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def _static_train_and_eval(train_ids, eval_ids, train_send, eval_send):
    """One table, a train and an eval FeatureSpec both named "ids" (seed 001), static shapes."""
    lifecycle.init(use_dynamic=False)
    train_spec, eval_spec = FeatureSpec("ids", table_name="t"), FeatureSpec("ids", table_name="t")
    train_it, train_batch = batched_iterator({"ids": train_ids}, 4, [train_spec], is_training=True)
    eval_it, eval_batch = batched_iterator({"ids": eval_ids}, 4, [eval_spec], is_training=False)
    table = create_table(tf.int64, 2, "t", slot_row_initializer, device_vocabulary_size=100)
    train_out = sparse_lookup(table, train_spec, train_send, batch=train_batch, is_train=True)
    eval_out = sparse_lookup(table, eval_spec, eval_send, batch=eval_batch, is_train=False)
    start_asc_pipeline()
    return (train_it, train_out), (eval_it, eval_out)


def test_train_and_eval_lookups_of_one_name_keep_their_own_send_count(graph):
    train_ids = np.arange(32).reshape(16, 2)  # 8 distinct ids per batch of 4
    eval_ids = np.tile([[0, 1]], (8, 1))      # 2 distinct ids per batch
    (train_it, train_out), (eval_it, eval_out) = _static_train_and_eval(train_ids, eval_ids, 8, 2)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        trained = run_all(sess, train_it, train_out)
        evaluated = run_all(sess, eval_it, eval_out)
    assert len(trained) == 4 and len(evaluated) == 2
    np.testing.assert_array_equal(np.concatenate(trained)[..., 0], np.arange(32).reshape(16, 2))
    np.testing.assert_array_equal(np.concatenate(evaluated)[..., 0], eval_ids)


def test_an_eval_batch_over_its_own_send_count_names_it(graph):
    (_, _), (eval_it, eval_out) = _static_train_and_eval(np.zeros((4, 2), np.int64), np.arange(16).reshape(8, 2),
                                                         8, 2)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(eval_it.initializer)
        with pytest.raises(tf.errors.OpError, match=r"feature 'ids' of table 't': rank 0 has 8 unique keys for "
                                                    r"rank 0, more than send_count=2"):
            sess.run(eval_out)


IDS = np.arange(8).reshape(4, 2)


def _one_lookup(access_and_evict_config=None, ids=None, **spec_kwargs):
    """One lookup of IDS built as the call gives it; run, its rows (key k reads row k: keys come in
    order to a fresh table with slot_row_initializer)."""
    lifecycle.init()
    spec = FeatureSpec("ids", table_name="t", **spec_kwargs)
    iterator, batch = batched_iterator({"ids": IDS}, 2, [spec])
    table = create_table(tf.int64, 2, "t", slot_row_initializer, device_vocabulary_size=10)
    out = sparse_lookup(table, spec if ids is None else ids(spec), batch=batch,
                        access_and_evict_config=access_and_evict_config)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        return np.concatenate(run_all(sess, iterator, out))


def test_seed_001_passes_access_and_evict_config_in_feature_spec_mode(graph):
    rows = _one_lookup({"access_threshold": -1, "eviction_threshold": -1})
    np.testing.assert_array_equal(rows, np.repeat(IDS[..., None], 2, axis=-1).astype(np.float32))


def test_an_access_and_evict_config_that_disagrees_with_the_feature_spec_names_both(graph):
    with pytest.raises(ValueError, match=r"access_and_evict_config\['access_threshold'\] = 5 disagrees with "
                                         r"FeatureSpec 'ids''s access_threshold = None"):
        _one_lookup({"access_threshold": 5, "eviction_threshold": -1})


def test_seed_003_passes_a_list_holding_one_feature_spec(graph):
    np.testing.assert_array_equal(_one_lookup(ids=lambda spec: [spec]),
                                  np.repeat(IDS[..., None], 2, axis=-1).astype(np.float32))


def test_a_list_of_several_feature_specs_is_refused(graph):
    other = FeatureSpec("other", table_name="t")
    with pytest.raises(ValueError, match=r"a list of 2 FeatureSpecs \('ids', 'other'\); a lookup takes one: call "
                                         r"sparse_lookup once per FeatureSpec"):
        _one_lookup(ids=lambda spec: [spec, other])


@pytest.mark.parametrize("call,expected", [
    (lambda: lifecycle.init(train_steps=123, eval_steps=7),
     "init(train_steps=123, eval_steps=7): step counts have no effect in shardrec"),
    (lambda: (lifecycle.init(), FeatureSpec("x", table_name="t", batch_size=77)),
     "FeatureSpec(batch_size=77) has no effect in shardrec"),
    (lambda: (lifecycle.init(), FeatureSpec("x", table_name="t", faae_coefficient=3)),
     "FeatureSpec(faae_coefficient=3) has no effect in shardrec"),
    (lambda: (lifecycle.init(), get_asc_insert_func([FeatureSpec("x", table_name="t")], dump_graph=True)),
     "get_asc_insert_func(dump_graph=True) has no effect in FeatureSpec mode"),
    (lambda: (lifecycle.init(), create_table(tf.int64, 2, "ssd_t", tf.compat.v1.zeros_initializer(),
                                          ssd_data_path=["/data/ssd"])),
     "create_table('ssd_t'): ssd_data_path has no effect with ssd_vocabulary_size=0"),
], ids=["steps", "batch_size", "faae_coefficient", "dump_graph", "ssd_data_path"])
def test_parameters_without_effect_say_so(graph, shardrec_warnings, call, expected):
    call()
    assert any(expected in message for message in shardrec_warnings), shardrec_warnings


def test_a_table_name_with_a_trailing_newline_is_refused(graph):
    lifecycle.init()
    with pytest.raises(ValueError, match=r"parameter 'name' = 'user\\n' is not allowed"):
        create_table(tf.int64, 2, "user\n", tf.compat.v1.zeros_initializer())


def test_a_feature_spec_naming_a_missing_table_is_reported_at_pipeline_start(graph):
    lifecycle.init()
    spec = FeatureSpec("ids", table_name="nowhere")
    batched_iterator({"ids": np.arange(8).reshape(4, 2)}, 2, [spec])
    create_table(tf.int64, 2, "t", tf.compat.v1.zeros_initializer())
    with pytest.raises(KeyError, match=r"feature 'ids' names table 'nowhere', which does not exist in this graph; "
                                       r"tables created so far: t"):
        start_asc_pipeline()


def test_an_int32_table_refuses_int64_ids_beyond_int32_naming_feature_and_table(graph):
    lifecycle.init()
    spec = FeatureSpec("ids", table_name="small")
    iterator, batch = batched_iterator({"ids": np.array([[1, 2], [3, 2**31 + 5]], np.int64)}, 1, [spec])
    table = create_table(tf.int32, 2, "small", slot_row_initializer, device_vocabulary_size=10)
    out = sparse_lookup(table, spec, batch=batch)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(iterator.initializer)
        sess.run(out)
        with pytest.raises(tf.errors.OpError, match=r"feature 'ids' on rank 0 has id 2147483653, outside table "
                                                    r"'small''s key dtype int32"):
            sess.run(out)
    assert table.size() == 2


IMPORT_CHECK = """
import os, sys
import tensorflow as tf
original_map, original_saver = tf.data.Dataset.map, tf.compat.v1.train.Saver
environ = dict(os.environ)
import mx_rec.core.embedding, mx_rec.core.asc.helper, mx_rec.core.asc.manager, mx_rec.util.initialize
import mx_rec.optimizers.lazy_adam, mx_rec.graph.modifier, mx_rec.estimator, shardrec.rank_runtime
maps = open("/proc/self/maps").read()
print("mpi4py.MPI loaded:", "mpi4py.MPI" in sys.modules)
print("libmpi mapped:", "libmpi" in maps)
print("map patched:", tf.data.Dataset.map is not original_map)
print("Saver patched:", tf.compat.v1.train.Saver is not original_saver)
print("excepthook changed:", sys.excepthook is not sys.__excepthook__)
print("environment changed:", dict(os.environ) != environ)
import importlib.metadata, importlib.util
print("installed top level:", importlib.metadata.distribution("shardrec").read_text("top_level.txt").split())
print("generic top level:", [n for n in ("rank_runtime", "orchestrator", "launch", "native", "shardrec_native")
                             if importlib.util.find_spec(n) is not None])
from shardrec.rank_runtime import init
init()
print("after init, map patched:", tf.data.Dataset.map is not original_map)
"""


def test_one_installed_tree_and_importing_mx_rec_starts_no_mpi_and_patches_nothing(tmp_path):
    # Run outside the repository, so that only what is installed can be imported.
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines == ["mpi4py.MPI loaded: False", "libmpi mapped: False", "map patched: False", "Saver patched: False",
                     "excepthook changed: False", "environment changed: False",
                     "installed top level: ['mx_rec', 'shardrec']", "generic top level: []",
                     "after init, map patched: True"]
