"""Every import path the seeds use resolves; parameters of capabilities not built yet fail loudly."""
import importlib

import pytest

import shardrec.rank_runtime

PATHS = {
    "mx_rec.core.embedding": ["create_table", "sparse_lookup"],
    "mx_rec.core.asc.feature_spec": ["FeatureSpec"],
    "mx_rec.core.asc.helper": ["get_asc_insert_func", "FeatureSpec"],
    "mx_rec.core.asc.manager": ["start_asc_pipeline"],
    "mx_rec.util.initialize": ["init", "terminate_config_initializer", "get_rank_id", "get_rank_size",
                               "get_initializer", "get_use_dynamic_expansion"],
    "mx_rec.util.variable": ["get_dense_and_sparse_variable"],
    "mx_rec.optimizers.lazy_adam": ["create_hash_optimizer"],
    "mx_rec.optimizers.gradient_descent": ["create_hash_optimizer"],
    "mx_rec.optimizers.adagrad": ["create_hash_optimizer"],
    "mx_rec.optimizers.ftrl": ["create_hash_optimizer"],
    "mx_rec.optimizers.lazy_adam_by_addr": ["create_hash_optimizer_by_address"],
    "mx_rec.optimizers.gradient_descent_by_addr": ["create_hash_optimizer_by_addr", "create_hash_optimizer_by_address"],
    "mx_rec.optimizers.adagrad_by_addr": ["create_hash_optimizer_by_address"],
    "mx_rec.graph.modifier": ["modify_graph_and_start_emb_cache", "GraphModifierHook"],
    "mx_rec.core.feature_process": ["EvictHook"],
    "mx_rec.constants.constants": ["ASCEND_SPARSE_LOOKUP_LOCAL_EMB", "ASCEND_SPARSE_LOOKUP_ID_OFFSET"],
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_import_paths_resolve(path):
    module = importlib.import_module(path)
    for name in PATHS[path]:
        assert hasattr(module, name), f"{path}.{name}"


def test_facade_objects_are_the_runtime_objects():
    from mx_rec.core.embedding import create_table, sparse_lookup
    from mx_rec.util.initialize import init

    assert create_table is shardrec.rank_runtime.create_table
    assert sparse_lookup is shardrec.rank_runtime.sparse_lookup
    assert init is shardrec.rank_runtime.init


def test_host_vocabulary_without_an_ssd_tier_adds_memory_rows(runtime):
    """On a CPU host the device and host tiers are both memory: their sum is the table's rows."""
    import tensorflow as tf

    from shardrec.rank_runtime import create_table

    table = create_table(tf.int64, 4, "t", tf.compat.v1.zeros_initializer(), device_vocabulary_size=30,
                         host_vocabulary_size=100)
    assert table.capacity() == 130 and table.max_rows() == 130 and table.ssd is None
