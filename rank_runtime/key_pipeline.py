"""The key pipeline: the dataset map function that turns each batch's ids into table rows.

``get_asc_insert_func`` returns a function for ``tf.data.Dataset.map``. For every FeatureSpec it
adds two int32 tensors to the batch: the rows (slots) of the batch's unique ids and, per id, the
index of its unique id. The work is one native call per feature and batch (dedup + index lookup,
GIL released); nothing in Python touches single keys. The map must stay sequential
(no num_parallel_calls): slots are allocated in batch order, which keeps training deterministic.
"""
import numpy as np
import tensorflow as tf

from . import config
from .feature_spec import FeatureSpec
from .logs import get_logger
from .validation import check_bool, check_type

log = get_logger("shardrec.pipeline")

_PREFIX = "_shardrec"


def slots_key(feature_name):
    return f"{_PREFIX}/{feature_name}/slots"


def restore_key(feature_name):
    return f"{_PREFIX}/{feature_name}/restore"


class _BatchKeyProcessor:
    """Runs inside tf.numpy_function: one call per batch, all features of the insert function."""

    def __init__(self, specs, is_training):
        self.specs = specs
        self.is_training = is_training

    def _table(self, spec):
        try:
            return config.get_table(spec.table_name)
        except KeyError as e:
            raise KeyError(f"feature {spec.name!r}: {e.args[0]}") from None

    def __call__(self, *key_arrays):
        cfg = config.get_config()
        if not cfg.pipeline_started:
            raise RuntimeError("the key pipeline is not started: call start_asc_pipeline() (or "
                               "modify_graph_and_start_emb_cache()) after building the graph and before running it")
        out = []
        for spec, keys in zip(self.specs, key_arrays):
            table = self._table(spec)
            pad_to = 0 if cfg.use_dynamic else table.send_counts[spec.name]
            slots, restore, _ = table.index.process_batch(np.ravel(keys), self.is_training, pad_to)
            out += (slots, restore)
        return out


def get_asc_insert_func(tgt_key_specs, is_training=True, dump_graph=False, **kwargs):
    """Returns the map function that hands every batch's ids to the key pipeline."""
    owner = "get_asc_insert_func"
    config.get_config()
    if isinstance(tgt_key_specs, FeatureSpec):
        tgt_key_specs = [tgt_key_specs]
    check_type(owner, "tgt_key_specs", tgt_key_specs, (list, tuple), "a list of FeatureSpec")
    for spec in tgt_key_specs:
        check_type(owner, "tgt_key_specs", spec, FeatureSpec, "a list of FeatureSpec")
    check_bool(owner, "is_training", is_training)
    check_bool(owner, "dump_graph", dump_graph)
    if kwargs:
        raise TypeError(f"{owner}: unknown parameter(s) {sorted(kwargs)}")
    specs = [s for s in tgt_key_specs if not s.is_timestamp]
    names = [s.name for s in specs]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"{owner}: feature names must be unique, repeated: {duplicated}")
    if not specs:
        raise ValueError(f"{owner}: tgt_key_specs holds no table feature")
    processor = _BatchKeyProcessor(specs, is_training)

    def insert_fn(batch):
        if not isinstance(batch, dict):
            raise TypeError(f"{owner}: dataset elements must be dicts of feature name to tensor, got {type(batch).__name__}")
        batch = dict(batch)
        keys = []
        for spec in specs:
            if spec.index_key not in batch:
                raise KeyError(f"{owner}: feature {spec.name!r} reads dataset key {spec.index_key!r}, which the "
                               f"dataset does not have; it has: {sorted(map(str, batch))}")
            ids = batch[spec.index_key]
            if ids.dtype not in (tf.int32, tf.int64):
                raise TypeError(f"{owner}: feature {spec.name!r} has ids of dtype {ids.dtype.name}; "
                                "ids must be int32 or int64")
            keys.append(ids)
        outs = tf.numpy_function(processor, keys, [tf.int32, tf.int32] * len(specs), stateful=True,
                                 name="shardrec_key_pipeline")
        for i, spec in enumerate(specs):
            slots, restore = outs[2 * i], outs[2 * i + 1]
            slots.set_shape([None])
            restore.set_shape([keys[i].shape.num_elements()])
            batch[slots_key(spec.name)] = slots
            batch[restore_key(spec.name)] = restore
        return batch

    if dump_graph:
        log.info("dump_graph=True: FeatureSpec mode does not rewrite the graph, nothing to dump")
    return insert_fn


def start_asc_pipeline():
    """Freezes the table configuration and lets the datasets' key processing run."""
    cfg = config.get_config()
    if not cfg.use_dynamic:
        for table in cfg.tables.values():
            if table.lookup_count and not table.send_counts:
                raise RuntimeError(f"table {table.table_name!r}: static shapes need a send_count from sparse_lookup")
    cfg.pipeline_started = True
    log.info("key pipeline started for %d table(s)", len(cfg.tables))
