"""Every parameter out of its range gets an error naming the parameter and what is allowed."""
import numpy as np
import pytest
import tensorflow as tf

from mx_rec.optimizers import adagrad, ftrl, gradient_descent, lazy_adam
from pipeline_helpers import FeatureSpec, batched_iterator
from shardrec.rank_runtime.process import config, lifecycle
from shardrec.rank_runtime import create_table, get_asc_insert_func, sparse_lookup

INIT = tf.compat.v1.zeros_initializer()


def table_kwargs(**over):
    kw = dict(key_dtype=tf.int64, dim=4, name="t", emb_initializer=INIT, device_vocabulary_size=10)
    kw.update(over)
    return kw


CREATE_TABLE = [
    ("key_dtype", {"key_dtype": tf.float32}, TypeError, r"'key_dtype' must be tf.int64 or tf.int32"),
    ("key_dtype", {"key_dtype": "string"}, TypeError, r"'key_dtype' must be tf.int64 or tf.int32"),
    ("dim", {"dim": 0}, ValueError, r"'dim' = 0 .*\[1, 8192\]"),
    ("dim", {"dim": 8193}, ValueError, r"'dim' = 8193 .*\[1, 8192\]"),
    ("dim", {"dim": 2.5}, TypeError, r"'dim' must be an int in \[1, 8192\]"),
    ("dim", {"dim": tf.TensorShape([2, 2])}, ValueError, r"'dim' as a TensorShape must be 1-D"),
    ("name", {"name": "a/b"}, ValueError, r"'name' = 'a/b' .*letters, digits, '_' and '.'"),
    ("name", {"name": "x..y"}, ValueError, r"'name' = 'x..y' .*not '..'"),
    ("name", {"name": ".."}, ValueError, r"'name' = '..'"),
    ("name", {"name": ""}, ValueError, r"'name' = '' .*1 to 100 characters"),
    ("name", {"name": "n" * 101}, ValueError, r"1 to 100 characters"),
    ("name", {"name": 7}, TypeError, r"'name' must be a string"),
    ("emb_initializer", {"emb_initializer": 3}, TypeError, r"'emb_initializer' must be a TensorFlow initializer"),
    ("device_vocabulary_size", {"device_vocabulary_size": 0}, ValueError, r"'device_vocabulary_size' = 0 .*\[1, 1000000000\]"),
    ("device_vocabulary_size", {"device_vocabulary_size": 10**9 + 1}, ValueError, r"\[1, 1000000000\]"),
    ("host_vocabulary_size", {"host_vocabulary_size": -1}, ValueError, r"'host_vocabulary_size' = -1 .*\[0, 10000000000\]"),
    ("ssd_vocabulary_size", {"ssd_vocabulary_size": 10**10 + 1}, ValueError, r"'ssd_vocabulary_size' .*\[0, 10000000000\]"),
    ("ssd_vocabulary_size", {"ssd_vocabulary_size": 5}, ValueError, r"ssd_vocabulary_size = 5 needs host_vocabulary_size > 0"),
    ("ssd_data_path", {"ssd_data_path": 5}, TypeError, r"'ssd_data_path' must be a list of directory paths"),
    ("is_save", {"is_save": "yes"}, TypeError, r"'is_save' must be a bool"),
    ("init_param", {"init_param": 10.5}, ValueError, r"'init_param' = 10.5 .*\[-10, 10\]"),
    ("all2all_gradients_op", {"all2all_gradients_op": "mean"}, ValueError,
     r"'all2all_gradients_op' = 'mean' .*'sum_gradients', 'sum_gradients_and_div_by_ranksize'"),
    ("value_dtype", {"value_dtype": tf.float64}, TypeError,
     r"'value_dtype' must be one of tf.float32, tf.float16, tf.bfloat16, got tf.float64"),
    ("slot_dtype", {"slot_dtype": tf.float16}, TypeError, r"'slot_dtype' must be one of tf.float32, tf.bfloat16, got "
     r"tf.float16"),
    ("stochastic_rounding", {"stochastic_rounding": "yes"}, TypeError, r"'stochastic_rounding' must be a bool"),
    ("exchange_dtype", {"exchange_dtype": "int8"}, TypeError,
     r"'exchange_dtype' must be one of tf.float32, tf.float16, tf.bfloat16, got 'int8'"),
    ("value_dtype with SSD", {"value_dtype": tf.bfloat16, "host_vocabulary_size": 8, "ssd_vocabulary_size": 64},
     ValueError, r"16-bit rows .* and an SSD tier .* cannot be used together; allowed with an SSD tier: "
     r"value_dtype=tf.float32"),
    ("shard_num", {"shard_num": 0}, ValueError, r"'shard_num' = 0"),
]


@pytest.mark.parametrize("param,over,exc,message", CREATE_TABLE, ids=[f"{c[0]}-{i}" for i, c in enumerate(CREATE_TABLE)])
def test_create_table(runtime, param, over, exc, message):
    with pytest.raises(exc, match=message):
        create_table(**table_kwargs(**over))
    assert "t" not in config.get_config().tables


def test_create_table_duplicate_name(runtime):
    create_table(**table_kwargs())
    with pytest.raises(ValueError, match=r"table named 't' already exists"):
        create_table(**table_kwargs())


def test_create_table_before_init(graph):
    with pytest.raises(RuntimeError, match=r"call mx_rec.util.initialize.init"):
        create_table(**table_kwargs())


FEATURE_SPEC = [
    ("name", dict(name=""), ValueError, r"'name' must be a non-empty string"),
    ("name", dict(name=3), TypeError, r"'name' must be a non-empty string"),
    ("table_name", dict(name="f"), ValueError, r"'table_name' is required"),
    ("index_key", dict(name="f", table_name="t", index_key=1.5), TypeError, r"'index_key' must be"),
    ("access_threshold", dict(name="f", table_name="t", access_threshold=-2), ValueError,
     r"'access_threshold' = -2 .*\[-1, 2147483647\]"),
    ("eviction_threshold", dict(name="f", table_name="t", eviction_threshold=2**31), ValueError,
     r"'eviction_threshold' = 2147483648 .*\[-1, 2147483647\]"),
    ("eviction_threshold", dict(name="f", table_name="t", eviction_threshold=5), ValueError,
     r"eviction_threshold = 5 needs admission"),
    ("batch_size", dict(name="f", table_name="t", batch_size=0), ValueError, r"'batch_size' = 0 .*\[1, 2147483647\]"),
    ("faae_coefficient", dict(name="f", table_name="t", faae_coefficient=0), ValueError,
     r"'faae_coefficient' = 0 .*\[1, 2147483647\]"),
    ("is_timestamp", dict(name="f", table_name="t", is_timestamp="yes"), TypeError, r"'is_timestamp' must be a bool"),
]


@pytest.mark.parametrize("param,kwargs,exc,message", FEATURE_SPEC, ids=[f"{c[0]}-{i}" for i, c in enumerate(FEATURE_SPEC)])
def test_feature_spec(param, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        FeatureSpec(**kwargs)


INIT_CASES = [
    ("max_steps", dict(max_steps=-2), ValueError, r"'max_steps' = -2 .*\[-1, 2147483647\]"),
    ("train_steps", dict(train_steps=2**31), ValueError, r"'train_steps' = 2147483648 .*\[-1, 2147483647\]"),
    ("eval_steps", dict(eval_steps=1.5), TypeError, r"'eval_steps' must be an int in \[-1, 2147483647\]"),
    ("save_steps", dict(save_steps=-7), ValueError, r"'save_steps' = -7"),
    ("all steps", dict(max_steps=0, train_steps=0, eval_steps=0, save_steps=0), ValueError, r"all 0"),
    ("use_dynamic", dict(use_dynamic="yes"), TypeError, r"'use_dynamic' must be a bool"),
    ("use_dynamic_expansion", dict(use_dynamic_expansion=1), TypeError, r"'use_dynamic_expansion' must be a bool"),
    ("if_load", dict(if_load=None), TypeError, r"'if_load' must be a bool"),
    ("bind_cpu", dict(bind_cpu="no"), TypeError, r"'bind_cpu' must be a bool"),
    ("is_incremental_checkpoint", dict(is_incremental_checkpoint=1), TypeError,
     r"'is_incremental_checkpoint' must be a bool"),
    ("incremental without timers", dict(is_incremental_checkpoint=True), ValueError,
     r"needs save_checkpoint_due_time and save_delta_checkpoints_secs"),
    ("incremental without delta timer", dict(is_incremental_checkpoint=True, save_checkpoint_due_time=4), ValueError,
     r"needs save_delta_checkpoints_secs \(seconds"),
    ("save_checkpoint_due_time", dict(save_checkpoint_due_time=0), ValueError,
     r"'save_checkpoint_due_time' = 0 .*\[1, 2147483647\]"),
    ("save_delta_checkpoints_secs", dict(save_delta_checkpoints_secs=2.5), TypeError,
     r"'save_delta_checkpoints_secs' must be an int in \[1, 2147483647\]"),
    ("restore_model_version", dict(restore_model_version=-1), ValueError,
     r"'restore_model_version' = -1 .*\[0, 2147483647\]"),
    ("recent_key_count_threshold", dict(recent_key_count_threshold=-3), ValueError,
     r"'recent_key_count_threshold' = -3 .*\[0, 2147483647\]"),
    ("use_lccl", dict(use_lccl="x"), TypeError, r"'use_lccl' must be a bool"),
    ("use_mpi", dict(use_mpi=False), ValueError, r"always runs on MPI"),
    ("unknown", dict(use_magic=True), TypeError, r"unknown parameter\(s\) \['use_magic'\]; init takes \[.*'restore_model_version'"),
]


@pytest.mark.parametrize("param,kwargs,exc,message", INIT_CASES, ids=[c[0] for c in INIT_CASES])
def test_init(graph, param, kwargs, exc, message):
    with pytest.raises(exc, match=message):
        lifecycle.init(**kwargs)
    assert not config.is_initialized()


def test_init_takes_the_rec_sdk_guides_parameters(graph):
    """Every parameter of the guide's init table: each works, or is said once in the log."""
    cfg = lifecycle.init(max_steps=200, train_steps=100, eval_steps=10, save_steps=100, use_dynamic=True,
                         use_dynamic_expansion=False, if_load=False, bind_cpu=False, is_incremental_checkpoint=True,
                         save_checkpoint_due_time=4, save_delta_checkpoints_secs=2, restore_model_version=3,
                         recent_key_count_threshold=2, use_lccl=False, use_hot=True, use_shm_swap=False)
    assert cfg.incremental == config.IncrementalCheckpoints(full_every_s=4, delta_every_s=2)
    assert cfg.restore_model_version == 3
    from shardrec.rank_runtime.process.logs import warned_once

    for name, why in (("use_lccl=False", "Ascend's LCCL collectives; shardrec uses MPI and Horovod"),
                      ("use_hot=True", "hot-embedding caching on the device; every row here is in host memory"),
                      ("use_shm_swap=False", "deprecated by the Rec SDK itself (its USE_SHM_SWAP environment variable)")):
        assert warned_once(f"init({name}) has no effect in shardrec: {why}"), name
    assert warned_once("init(recent_key_count_threshold=2): shardrec's delta checkpoints hold every row that changed, "
                       "whatever its count, so that a restore is exact; the filter is not applied")


def test_init_twice(runtime):
    with pytest.raises(RuntimeError, match=r"already initialised.*terminate_config_initializer"):
        lifecycle.init()
    lifecycle.terminate_config_initializer()
    lifecycle.init()


OPTIMIZERS = [
    (gradient_descent, dict(learning_rate=-0.1), r"'learning_rate' = -0.1 .*\[0, 10\]"),
    (gradient_descent, dict(learning_rate=10.5), r"'learning_rate' = 10.5 .*\[0, 10\]"),
    (adagrad, dict(learning_rate=11), r"'learning_rate' = 11 .*\[0, 10\]"),
    (adagrad, dict(initial_accumulator_value=0), r"'initial_accumulator_value' = 0 .*\(0, 1\]"),
    (adagrad, dict(initial_accumulator_value=1.5), r"'initial_accumulator_value' = 1.5 .*\(0, 1\]"),
    (lazy_adam, dict(learning_rate=-1), r"'learning_rate' = -1 .*\[0, 10\]"),
    (lazy_adam, dict(beta1=0.0), r"'beta1' = 0.0 .*\(0, 1\)"),
    (lazy_adam, dict(beta1=1.0), r"'beta1' = 1.0 .*\(0, 1\)"),
    (lazy_adam, dict(beta2=1.5), r"'beta2' = 1.5 .*\[0, 1\]"),
    (lazy_adam, dict(epsilon=0), r"'epsilon' = 0 .*\(0, 1\]"),
    (ftrl, dict(learning_rate=20), r"'learning_rate' = 20 .*\[0, 10\]"),
    (ftrl, dict(l1_regularization_strength=-1), r"'l1_regularization_strength' = -1 .*\[0, 10000.0\]"),
    (ftrl, dict(l2_regularization_strength=1e5), r"'l2_regularization_strength' = 100000.0 .*\[0, 10000.0\]"),
    (ftrl, dict(learning_rate_power=0.5), r"'learning_rate_power' = 0.5 .*\(-inf, 0\]"),
    (ftrl, dict(initial_accumulator_value=-1), r"'initial_accumulator_value' = -1 .*\[0, inf\)"),
]


@pytest.mark.parametrize("module,kwargs,message", OPTIMIZERS,
                         ids=[f"{m.__name__.rsplit('.', 1)[-1]}-{next(iter(k))}-{i}" for i, (m, k, _) in enumerate(OPTIMIZERS)])
def test_optimizer(module, kwargs, message):
    kwargs.setdefault("learning_rate", 0.1)
    with pytest.raises(ValueError, match=message):
        module.create_hash_optimizer(**kwargs)


def test_optimizer_type_error():
    with pytest.raises(TypeError, match=r"'learning_rate' must be a number in \[0, 10\]"):
        lazy_adam.create_hash_optimizer(learning_rate="fast")


def test_sparse_optimizer_refuses_dense_variables(runtime):
    var = tf.compat.v1.Variable(tf.zeros([3]), use_resource=True)
    opt = gradient_descent.create_hash_optimizer(0.1)
    with pytest.raises(TypeError, match=r"is not a sparse table"):
        opt.apply_gradients([(tf.zeros([3]), var)])


@pytest.fixture
def lookup_setup(runtime):
    spec = FeatureSpec("ids", table_name="t")
    _, batch = batched_iterator({"ids": np.arange(8).reshape(4, 2)}, 2, [spec])
    table = create_table(**table_kwargs())
    return table, spec, batch


SPARSE_LOOKUP = [
    ("send_count", dict(send_count=0), ValueError, r"'send_count' = 0 .*\[1, 2147483647\]"),
    ("send_count", dict(send_count=2**31), ValueError, r"'send_count' = 2147483648 .*\[1, 2147483647\]"),
    ("dim", dict(dim=5), ValueError, r"'dim' = 5 .*\[4, 4\]"),
    ("is_train", dict(is_train="yes"), TypeError, r"'is_train' must be a bool"),
    ("is_grad", dict(is_grad=0), TypeError, r"'is_grad' must be a bool"),
    ("modify_graph", dict(modify_graph="no"), TypeError, r"'modify_graph' must be a bool"),
    ("name", dict(name=5), TypeError, r"'name' must be a string"),
    ("batch", dict(batch=None), ValueError, r"pass batch="),
    ("batch", dict(batch={"ids": tf.zeros([2], tf.int64)}), ValueError, r"was not processed by the key pipeline"),
    ("access_and_evict_config", dict(access_and_evict_config={"bogus": 1}), ValueError,
     r"unknown key\(s\) \['bogus'\]; allowed: 'access_threshold', 'eviction_threshold'"),
    ("access_and_evict_config", dict(access_and_evict_config=[1]), TypeError, r"'access_and_evict_config' must be a dict"),
]


@pytest.mark.parametrize("param,kwargs,exc,message", SPARSE_LOOKUP, ids=[f"{c[0]}-{i}" for i, c in enumerate(SPARSE_LOOKUP)])
def test_sparse_lookup(lookup_setup, param, kwargs, exc, message):
    table, spec, batch = lookup_setup
    kwargs.setdefault("batch", batch)
    with pytest.raises(exc, match=message):
        sparse_lookup(table, spec, **kwargs)


def test_sparse_lookup_wrong_objects(lookup_setup):
    table, spec, batch = lookup_setup
    with pytest.raises(TypeError, match=r"'hashtable' must be a table from create_table"):
        sparse_lookup("t", spec, batch=batch)
    with pytest.raises(TypeError, match=r"'ids' must be a FeatureSpec"):
        sparse_lookup(table, batch["ids"], batch=batch)
    with pytest.raises(ValueError, match=r"belongs to table 'other'"):
        sparse_lookup(table, FeatureSpec("ids", table_name="other"), batch=batch)


def test_sparse_lookup_at_most_128_times(lookup_setup):
    table, spec, batch = lookup_setup
    for _ in range(128):
        sparse_lookup(table, spec, batch=batch)
    with pytest.raises(ValueError, match=r"at most 128 lookups per table"):
        sparse_lookup(table, spec, batch=batch)


def test_static_shapes_need_send_count(graph):
    lifecycle.init(use_dynamic=False)
    spec = FeatureSpec("ids", table_name="t")
    _, batch = batched_iterator({"ids": np.arange(8).reshape(4, 2)}, 2, [spec])
    table = create_table(**table_kwargs())
    with pytest.raises(ValueError, match=r"'send_count' is required with static shapes"):
        sparse_lookup(table, spec, batch=batch)


def test_float_keys_are_refused_when_the_dataset_is_mapped(runtime):
    dataset = tf.data.Dataset.from_tensor_slices({"ids": np.zeros((4, 2), np.float32)}).batch(2)
    with pytest.raises(TypeError, match=r"feature 'ids' has ids of dtype float32; ids must be int32 or int64"):
        dataset.map(get_asc_insert_func([FeatureSpec("ids", table_name="t")], is_training=True))


def test_insert_func_bad_arguments(runtime):
    with pytest.raises(TypeError, match=r"'tgt_key_specs' must be a list of FeatureSpec"):
        get_asc_insert_func(["ids"], is_training=True)
    with pytest.raises(TypeError, match=r"'is_training' must be a bool"):
        get_asc_insert_func([FeatureSpec("ids", table_name="t")], is_training="yes")
    with pytest.raises(ValueError, match=r"feature names must be unique"):
        get_asc_insert_func([FeatureSpec("ids", table_name="t"), FeatureSpec("ids", table_name="u")])
    dataset = tf.data.Dataset.from_tensor_slices({"ids": np.zeros((4, 2), np.int64)}).batch(2)
    with pytest.raises(KeyError, match=r"reads dataset key 'missing'"):
        dataset.map(get_asc_insert_func([FeatureSpec("f", table_name="t", index_key="missing")]))
