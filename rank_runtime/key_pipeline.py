"""The key pipeline: what ``dataset.map(get_asc_insert_func(...))`` inserts into a dataset.

For every batch and every FeatureSpec it adds five int32 tensors to the batch: the distinct local
rows this rank gathers for its peers, the index that expands them to one row per received key,
the send / receive splits of the row all-to-all, and the restore indices that put the returned
rows in batch order. The work is one native call per batch (dedup,
MPI all-to-all of the keys, index lookup; GIL released); nothing in Python touches single keys.

Every rank must see the same number of batches, or a collective waits for ever. A map function
never learns that its input ended, so ``Dataset.map`` is wrapped to recognise an insert function
and build, instead of a plain map: the data, then one end marker, then the key exchange, then
``take_while``. A rank that reaches its marker tells the others inside the same exchange round,
and every rank's dataset ends at that same batch. The map runs sequentially (no
num_parallel_calls): rows are allocated in batch order and the collectives of all ranks match.
"""
import functools
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.data.ops import dataset_ops

from . import config
from .feature_spec import FeatureSpec
from .logs import get_logger
from .validation import check_bool, check_type
from .world import get_world

log = get_logger("shardrec.pipeline")

_PREFIX = "_shardrec"
_FIELDS = ("slots", "expand", "send_splits", "recv_splits", "restore")


def pipeline_key(feature_name, field):
    return f"{_PREFIX}/{feature_name}/{field}"


class _BatchKeyProcessor:
    """Runs inside tf.numpy_function: one call per batch for all features of an insert function."""

    def __init__(self, specs, channel, graph):
        self.specs = specs
        self.channel = channel
        # The graph the dataset was built in: the tables are looked up there when the first batch
        # runs (seed 001 builds the dataset before it creates the tables).
        self.graph = weakref.ref(graph)
        self.batches = 0

    def __call__(self, is_end, *key_arrays):
        cfg = config.get_config()
        graph = self.graph()
        if graph is None or not cfg.graph_state(graph).pipeline_started:
            raise RuntimeError("the key pipeline is not started: call start_asc_pipeline() (or "
                               "modify_graph_and_start_emb_cache()) after building the graph and before running it")
        tables = [config.get_table(spec.table_name, graph) for spec in self.specs]
        send_counts = [0 if cfg.use_dynamic else t.send_counts[s.name] for t, s in zip(tables, self.specs)]
        exchange = get_world().exchanges[self.channel]
        result = exchange.run([t.index for t in tables], list(key_arrays), send_counts, not bool(is_end))
        if result is None:
            log.info("%s data: %s after %d batches; every rank stops this pass at the same batch",
                     self.channel, "this rank has no more" if is_end else "another rank ran out of data",
                     self.batches)
            self.batches = 0
            size = cfg.size
            empty = np.zeros(0, np.int32)
            return [np.True_] + [a for keys in key_arrays
                                 for a in (empty, empty, np.zeros(size, np.int32), np.zeros(size, np.int32),
                                           np.zeros(np.size(keys), np.int32))]
        self.batches += 1
        return [np.False_] + [a for outputs in result for a in outputs]


def _end_marker(element_spec):
    """One element shaped like the data (unknown dimensions as 0), flagged as the end."""
    def zeros(spec):
        if not isinstance(spec, tf.TensorSpec):
            raise TypeError(f"get_asc_insert_func: dataset elements must be dicts of dense tensors, got {spec}")
        shape = [0 if d is None else d for d in spec.shape.as_list()]
        return tf.fill(shape, "") if spec.dtype == tf.string else tf.zeros(shape, spec.dtype)

    return tf.nest.map_structure(zeros, element_spec)


class InsertFunction:
    """What get_asc_insert_func returns; ``dataset.map`` recognises it (see the module doc)."""

    def __init__(self, specs, is_training):
        self.specs = specs
        self.channel = "train" if is_training else "eval"
        self._processor = _BatchKeyProcessor(specs, self.channel, tf.compat.v1.get_default_graph())

    def __call__(self, batch):
        raise TypeError("the function from get_asc_insert_func must be applied with dataset.map(insert_fn)")

    def _check_element(self, element_spec):
        if not isinstance(element_spec, dict):
            raise TypeError("get_asc_insert_func: dataset elements must be dicts of feature name to tensor, "
                            f"got {element_spec}")
        for spec in self.specs:
            if spec.index_key not in element_spec:
                raise KeyError(f"get_asc_insert_func: feature {spec.name!r} reads dataset key {spec.index_key!r}, "
                               f"which the dataset does not have; it has: {sorted(map(str, element_spec))}")
            dtype = element_spec[spec.index_key].dtype
            if dtype not in (tf.int32, tf.int64):
                raise TypeError(f"get_asc_insert_func: feature {spec.name!r} has ids of dtype {dtype.name}; "
                                "ids must be int32 or int64")

    def _exchange(self, batch, is_end):
        batch = dict(batch)
        keys = [batch[spec.index_key] for spec in self.specs]
        width = len(_FIELDS)
        outs = tf.numpy_function(self._processor, [is_end] + keys, [tf.bool] + [tf.int32] * (width * len(self.specs)),
                                 stateful=True, name="shardrec_key_exchange")
        stop = tf.reshape(outs[0], [])
        size = config.get_config().size
        for i, spec in enumerate(self.specs):
            slots, expand, send_splits, recv_splits, restore = outs[1 + width * i:1 + width * (i + 1)]
            slots.set_shape([None])
            expand.set_shape([None])
            send_splits.set_shape([size])
            recv_splits.set_shape([size])
            restore.set_shape([keys[i].shape.num_elements()])
            for field, value in zip(_FIELDS, (slots, expand, send_splits, recv_splits, restore)):
                batch[pipeline_key(spec.name, field)] = value
        return batch, stop

    def apply(self, dataset, num_parallel_calls=None, deterministic=None, name=None):
        self._check_element(dataset.element_spec)
        if num_parallel_calls is not None:
            log.warning("dataset.map(insert_fn, num_parallel_calls=%s): the key pipeline runs sequentially "
                        "so that every rank's exchanges stay in step", num_parallel_calls)
        marked = dataset.map(lambda batch: (batch, False))
        marked = marked.concatenate(tf.data.Dataset.from_tensors((_end_marker(dataset.element_spec), True)))
        processed = marked.map(self._exchange)
        processed = processed.take_while(lambda batch, stop: tf.logical_not(stop))
        return processed.map(lambda batch, stop: batch)


def _wrap_map(cls):
    original = cls.__dict__["map"]
    if getattr(original, "_shardrec_wrapped", False):
        return

    @functools.wraps(original)
    def map(self, map_func, *args, **kwargs):  # noqa: A001 - it is Dataset.map
        if isinstance(map_func, InsertFunction):
            out = map_func.apply(self, *args, **kwargs)
            return dataset_ops.DatasetV1Adapter(out) if isinstance(self, dataset_ops.DatasetV1) else out
        return original(self, map_func, *args, **kwargs)

    map._shardrec_wrapped = True
    cls.map = map


_wrap_map(dataset_ops.DatasetV2)
_wrap_map(dataset_ops.DatasetV1)


def get_asc_insert_func(tgt_key_specs, is_training=True, dump_graph=False, **kwargs):
    """Returns the function for ``dataset.map`` that hands every batch's ids to the key pipeline."""
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
    if dump_graph:
        log.info("dump_graph=True: FeatureSpec mode does not rewrite the graph, nothing to dump")
    return InsertFunction(specs, is_training)


def start_asc_pipeline():
    """Freezes the table configuration and lets the datasets' key processing run."""
    cfg = config.get_config()
    state = cfg.graph_state()
    if not cfg.use_dynamic:
        for table in state.tables.values():
            if table.lookup_count and not table.send_counts:
                raise RuntimeError(f"table {table.table_name!r}: static shapes need a send_count from sparse_lookup")
    state.pipeline_started = True
    log.info("key pipeline started for %d table(s)", len(state.tables))
