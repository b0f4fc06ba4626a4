"""The key pipeline: what ``dataset.map(get_asc_insert_func(...))`` inserts into a dataset.

For every batch and every FeatureSpec it adds the feature's routing (routing.py: the distinct
local rows this rank gathers for its peers, the index that expands them to one row per received
key, the receive splits of the row all-to-all, and the restore indices that put the returned rows
in batch order) to the batch. The work is one native call per batch (dedup, MPI all-to-all of the
keys, index lookup; GIL released); nothing in Python touches single keys.

Features are matched between ranks by name: each insert function hands its features to the
native exchange sorted by name, and every batch's status round carries a signature of the
feature list (names, tables, dims, key dtypes, send_count), so ranks that disagree stop at the
first batch with an error naming the first difference instead of training the wrong rows.

Every rank must see the same number of batches, or a collective waits (until the exchange's
timeout). A map function never learns that its input ended, so ``Dataset.map`` is wrapped (by
init(), tf_patches.py) to recognise an insert function and build, instead of a plain map: the
data, then one end marker, then the key exchange, then ``take_while``. A rank that reaches its
marker tells the others inside the same exchange round, and every rank's dataset ends at that same
batch. The map runs sequentially (no num_parallel_calls): rows are allocated in batch order and
the collectives of all ranks match.

Admission and eviction (admission/): a training insert function may carry one is_timestamp
FeatureSpec; its values (int64 seconds, one per sample) go into the exchange with the ids, and the
owner of each key counts its occurrences and keeps its newest timestamp.

After an exchange error (an overflowing send_count, a full table, an id outside its key dtype,
features that differ, a rank that did not arrive in time) the channel stops on every rank: each
later batch of that channel raises the same error, on every rank, without a collective. A
script that catches the error and goes on therefore stays in step; to train again, fix the cause
and restart the job.
"""
import weakref
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from ..process import batch_events, config, heartbeat, resize
from ..formats.channel import Channel
from ..admission.thresholds import Thresholds, configure_tables
from .feature_spec import FeatureSpec
from ..process.logs import get_logger, warn_once
from . import exchanges, ragged_ids, table_groups
from .routing import FeatureRouting, PoolRouting
from ..embedding import placing
from ..embedding.tiers import check_datasets
from ..validation import check_bool, check_type
from ..process.world import get_world

log = get_logger("shardrec.pipeline")


class _BatchKeyProcessor:
    """Runs inside tf.numpy_function: one call per batch for all features of an insert function."""

    def __init__(self, specs, channel, graph, timestamp):
        self.specs = specs  # sorted by name: the order every rank uses
        self.channel = channel
        self.timestamp = timestamp  # the is_timestamp FeatureSpec whose values come last, or None
        # The graph the dataset was built in: the tables are looked up there when the first batch
        # runs (the user guide's Session example builds the dataset before it creates the tables).
        self.graph = weakref.ref(graph)
        self.batches = 0
        self._features = None
        self.pooled = [False] * len(specs)  # variable-length features (InsertFunction.apply finds them)
        self._evicting = []
        self._tables = []

    def _feature_set(self, cfg, graph):
        if self._features is None:
            from ...native import core as native_core

            asked = exchanges.of_graph(graph)
            tables = [config.get_table(spec.table_name, graph) for spec in self.specs]
            features = [asked.feature(s.name, self.channel) for s in self.specs]
            send_counts = [0 if cfg.use_dynamic else f.send_count for f in features]
            pooled = [int(f.pooling(p)) for f, p in zip(features, self.pooled)]
            lines = [f"feature '{s.name}' (table '{t.table_name}', dim {t.dim}, key dtype {t.key_dtype.name}, "
                     f"send_count {c or 'dynamic'}, {(t.thresholds or Thresholds()).describe()}"
                     f"{('', ', pooled', ', pooled without weights')[p]}{_exchanged_in(t)}, {t.placement.describe()}"
                     f"{_grouped(graph, s.name, self.channel)})"
                     for s, t, c, p in zip(self.specs, tables, send_counts, pooled)]
            if self.timestamp is not None:
                lines.append(f"timestamps '{self.timestamp.name}'")
            self._evicting = [t for t in tables if t.thresholds is not None and t.thresholds.evicts]
            self._tables = list({t.table_name: t for t in tables}.values())
            if heartbeat.active():
                heartbeat.watch_tables({t.table_name: t for t in tables})
            self._features = native_core.FeatureSet([s.name for s in self.specs], [t.index for t in tables],
                                                        send_counts, [t.key_dtype == tf.int32 for t in tables],
                                                        "\n".join(lines),
                                                        self.timestamp.name if self.timestamp is not None else "",
                                                        pooled, [t.placement.native for t in tables],
                                                        [t.placement.native_slices for t in tables])
        return self._features

    def __call__(self, is_end, *key_arrays):
        timestamps = None
        if self.timestamp is not None:
            *key_arrays, timestamps = key_arrays
            timestamps = np.ascontiguousarray(timestamps, np.int64).reshape(-1)
        cfg = config.get_config()
        graph = self.graph()
        if graph is None or not cfg.graph_state(graph).pipeline_started:
            raise RuntimeError("the key pipeline is not started: call start_asc_pipeline() (or "
                               "modify_graph_and_start_emb_cache()) after building the graph and before running it")
        from ...native import core as native_core

        exchange = get_world().exchanges[self.channel]
        features = self._feature_set(cfg, graph)
        key_arrays = _pair_pooled(key_arrays, self.pooled)
        evictions = exchange.counters().evictions if self._evicting else 0
        # A resize the supervisor asked for ends the training input here, on every rank (resize.py).
        stop = self.channel == Channel.TRAIN and resize.requested()
        try:
            result = exchange.run(features, list(key_arrays), not (bool(is_end) or stop), timestamps)
        except native_core.PassClosedError as e:
            # A session closed (this rank's, or a peer's before this rank's prefetch ran out): the
            # pass ends, and the next session's starts counting afresh.
            self.batches = 0
            if isinstance(e, native_core.PeerClosedError):
                log.info("%s data: %s", self.channel.label, e)
            raise
        if self._evicting and exchange.counters().evictions != evictions:
            self._log_eviction(exchange)
        if result.ended:
            batches, self.batches = self.batches, 0
            batch_events.pass_ended(batch_events.PassEnded(self.channel, batches, stop, bool(is_end),
                                                           list(exchange.ranks_out_of_data)))
        else:
            self.batches += 1
            batch_events.batch_exchanged(batch_events.BatchExchanged(
                self.channel, self.batches, _examples(key_arrays[0]), tuple(self._tables), exchange))
        # The native routing's fields, by the names the dataset element files them under (routing.py).
        out = [np.bool_(result.ended)]
        for routing, pooled in zip(result.features, self.pooled):
            out.append(FeatureRouting.pack(routing))
            if pooled:
                out += [getattr(routing.pool, name) for name in PoolRouting.names()]
        return out

    def _log_eviction(self, exchange):
        step = exchange.counters().last_eviction_step
        log.info("eviction at step %d (before batch %d's keys): %s", step, step + 1, "; ".join(
            f"table {t.table_name}: " + ", ".join(f"{k} {v}" for k, v in t.admission_counters().as_dict().items())
            for t in self._evicting))


def _pair_pooled(key_arrays, pooled):
    """The numpy function's flat arguments as the native exchange takes them: a pooled feature's
    ids and row splits as one (ids, row_splits) pair."""
    keys, at = [], 0
    for is_pooled in pooled:
        keys.append((key_arrays[at], key_arrays[at + 1]) if is_pooled else key_arrays[at])
        at += 2 if is_pooled else 1
    return keys + list(key_arrays[at:])


def _examples(keys):
    """A batch's examples, from its first feature's ids (a pooled one's row splits)."""
    return len(keys[1]) - 1 if isinstance(keys, tuple) else len(keys)


def _end_marker(element_spec):
    """One element shaped like the data (unknown dimensions as 0), flagged as the end."""
    def zeros(spec):
        if ragged_ids.is_variable_length_spec(spec):
            return ragged_ids.empty_like(spec)
        if not isinstance(spec, tf.TensorSpec):
            raise TypeError("get_asc_insert_func: dataset elements must be dicts of tensors (dense, ragged or "
                            f"sparse), got {spec}")
        shape = [0 if d is None else d for d in spec.shape.as_list()]
        return tf.fill(shape, "") if spec.dtype == tf.string else tf.zeros(shape, spec.dtype)

    return tf.nest.map_structure(zeros, element_spec)


class InsertFunction:
    """What get_asc_insert_func returns; ``dataset.map`` recognises it (see the module doc)."""

    def __init__(self, specs, is_training):
        stamps = [s for s in specs if s.is_timestamp]
        self.specs = sorted((s for s in specs if not s.is_timestamp), key=lambda s: s.name)
        self.channel = Channel.of(is_training)
        self.timestamp = _timestamp_spec(self.specs, stamps, is_training)
        graph = tf.compat.v1.get_default_graph()
        self._processor = _BatchKeyProcessor(self.specs, self.channel, graph, self.timestamp)
        config.get_config().graph_state(graph).insert_functions.append(self)

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
            ragged_ids.check_spec("get_asc_insert_func", spec.name, element_spec[spec.index_key])
        pooled = [ragged_ids.is_variable_length_spec(element_spec[s.index_key]) for s in self.specs]
        if self._processor._features is not None and pooled != self._processor.pooled:
            raise ValueError("get_asc_insert_func: this insert function already runs on a dataset whose features "
                             "are variable-length in other places; make one insert function per dataset")
        self._processor.pooled = pooled
        if self.channel == Channel.TRAIN:
            self._count_ids(element_spec, pooled)
        if self.timestamp is not None:
            key = self.timestamp.index_key
            if key not in element_spec:
                raise KeyError(f"get_asc_insert_func: is_timestamp feature {self.timestamp.name!r} reads dataset key "
                               f"{key!r}, which the dataset does not have; it has: {sorted(map(str, element_spec))}")
            spec = element_spec[key]
            if spec.dtype != tf.int64 or not _one_per_sample(spec.shape):
                raise TypeError(f"get_asc_insert_func: is_timestamp feature {self.timestamp.name!r} is "
                                f"{spec.dtype.name} of shape {spec.shape}; timestamps must be int64 seconds of shape "
                                "[batch] or [batch, 1] (one per sample)")

    def _count_ids(self, element_spec, pooled):
        """Each table's ids per batch where the shapes say (a variable-length feature's: unknown)."""
        ids = config.get_config().graph_state().training_ids
        for spec, ragged in zip(self.specs, pooled):
            known = None if ragged else element_spec[spec.index_key].shape.num_elements()
            if known:
                ids[(spec.table_name, spec.name)] = known

    def _exchange(self, batch, is_end):
        batch = dict(batch)
        keys = [batch[spec.index_key] for spec in self.specs]
        stamps = [] if self.timestamp is None else [batch[self.timestamp.index_key]]
        inputs = [k for key in keys for k in (ragged_ids.key_inputs(key) if ragged_ids.is_variable_length(key)
                                              else [key])]
        pool_width = len(PoolRouting.names())
        outs = tf.numpy_function(self._processor, [is_end] + inputs + stamps,
                                 [tf.bool] + [tf.int32] * sum(1 + (pool_width if p else 0)
                                                              for p in self._processor.pooled),
                                 stateful=True, name="shardrec_key_exchange")
        stop = tf.reshape(outs[0], [])
        size = config.get_config().size
        at = 1
        for spec, pooled in zip(self.specs, self._processor.pooled):
            FeatureRouting.file_packed(batch, spec.name, outs[at])
            at += 1
            if pooled:
                PoolRouting(*outs[at:at + pool_width]).with_static_shapes(size, None).file_into(batch, spec.name)
                at += pool_width
        return batch, stop

    def apply(self, dataset, num_parallel_calls=None, deterministic=None, name=None):
        self._check_element(dataset.element_spec)
        if num_parallel_calls is not None:
            log.warning("dataset.map(insert_fn, num_parallel_calls=%s): the key pipeline runs sequentially "
                        "so that every rank's exchanges stay in step", num_parallel_calls)
        # Autograph would rewrite these functions (and the 30-odd they call) in every process that
        # builds the pipeline, about a second of a test job's start-up in its profile, for no
        # control flow on tensors.
        plain = tf.autograph.experimental.do_not_convert
        marked = dataset.map(plain(lambda batch: (batch, False)))
        marked = marked.concatenate(tf.data.Dataset.from_tensors((_end_marker(dataset.element_spec), True)))
        processed = marked.map(plain(self._exchange))
        processed = processed.take_while(plain(lambda batch, stop: tf.logical_not(stop)))
        return processed.map(plain(lambda batch, stop: batch))


def _one_per_sample(shape):
    """[batch], or [batch, 1] as the Rec SDK's examples build every feature column."""
    return shape.rank is None or shape.rank == 1 or (shape.rank == 2 and shape[1] == 1)


def _timestamp_spec(specs, stamps, is_training):
    """The insert function's is_timestamp FeatureSpec (at most one), which training features that
    evict need; evaluation reads no timestamps."""
    if len(stamps) > 1:
        raise ValueError(f"get_asc_insert_func: FeatureSpecs {', '.join(repr(s.name) for s in stamps)} all have "
                         "is_timestamp=True; a dataset has one timestamp feature for its tables: keep one")
    evicting = [s for s in specs if s.eviction]
    if is_training and evicting and not stamps:
        raise ValueError(f"get_asc_insert_func: feature {evicting[0].name!r} has eviction_threshold = "
                         f"{evicting[0].eviction_threshold}, which measures ages in the data's timestamps, but no "
                         "FeatureSpec(..., is_timestamp=True) is among tgt_key_specs; add one naming the dataset key "
                         "of the int64 timestamps, or set eviction_threshold=-1")
    return stamps[0] if stamps and is_training else None


def get_asc_insert_func(tgt_key_specs, is_training: bool = True, dump_graph: bool = False,
                        **kwargs) -> "InsertFunction":
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
    specs = list(tgt_key_specs)
    names = [s.name for s in specs]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"{owner}: feature names must be unique, repeated: {duplicated}")
    if all(s.is_timestamp for s in specs):
        raise ValueError(f"{owner}: tgt_key_specs holds no table feature")
    if dump_graph:
        warn_once("get_asc_insert_func(dump_graph=True) has no effect in FeatureSpec mode: shardrec does not rewrite "
                  "the graph there; graph modification dumps it with modify_graph_and_start_emb_cache(dump_graph=True)")
    return InsertFunction(specs, is_training)


def start_asc_pipeline() -> None:
    """Freezes the table configuration and lets the datasets' key processing run."""
    cfg = config.get_config()
    state = cfg.graph_state()
    table_groups.build(tf.compat.v1.get_default_graph())
    for insert in state.insert_functions:
        for spec in insert.specs:
            if spec.table_name not in state.tables:
                known = ", ".join(sorted(state.tables)) or "none"
                raise KeyError(f"start_asc_pipeline: feature {spec.name!r} names table {spec.table_name!r}, which "
                               f"does not exist in this graph; tables created so far: {known}")
    configure_tables(state.tables, state.insert_functions)
    check_datasets(state.tables, state.insert_functions)
    plan = placing.job_plan(cfg, state.tables)
    if cfg.rank == 0:
        log.info("%s", plan.render())
        grouped = table_groups.describe(tf.compat.v1.get_default_graph())
        if grouped:
            log.info("%s", grouped)
    if cfg.size > 1:
        grouped = table_groups.grouped_features(tf.compat.v1.get_default_graph())
        get_world().make_row_exchanges(exchanges.of_graph().names(), grouped)
    state.pipeline_started = True
    batch_events.register(_PassEndLog())
    log.info("key pipeline started for %d table(s)", len(state.tables))


def close_passes(graph) -> list:
    """A session of `graph` closes: its key pipeline's channels begin no round until
    reopen_passes(), and a peer's round that waits for a batch this rank's prefetch never began
    ends (native/src/exchange/pass_closing.h: a step limit stops sessions before their data ends,
    with each rank's prefetch wherever it was). Local: no collective. Returns the exchanges to
    reopen once the session's threads are gone."""
    if not config.is_initialized():
        return []
    state = config.get_config().graphs.get(graph)
    if state is None or not state.pipeline_started:
        return []
    world = get_world()
    closed = [world.exchanges[channel] for channel in sorted({insert.channel for insert in state.insert_functions})]
    for exchange in closed:
        exchange.close_pass()
    return closed


def reopen_passes(exchanges: list) -> None:
    """Rounds may begin again on the channels close_passes closed."""
    for exchange in exchanges:
        exchange.reopen_pass()


@dataclass(frozen=True)
class _PassEndLog(batch_events.Observer):
    """Says where and why a pass ended: every rank stops it at the same batch."""

    def pass_ended(self, event: batch_events.PassEnded) -> None:
        if event.for_stop:
            return  # resize.py says that one
        label, ranks = event.channel.label, list(event.ranks_out)
        if event.batches == 0:
            log.warning("%s data: rank(s) %s had no batch at all in this pass, so every rank stops it after 0 "
                        "batches; give every rank data (a shard of the dataset each)", label, ranks)
        else:
            log.info("%s data: %s after %d batches (rank(s) %s ran out); every rank stops this pass at the same "
                     "batch", label, "this rank has no more" if event.this_rank_ran_out else "another rank ran out",
                     event.batches, ranks)


def _grouped(graph, feature, channel) -> str:
    group = table_groups.group_of(graph, feature, channel)
    return f", lookup group '{group}'" if group else ""


def _exchanged_in(table) -> str:
    """A 16-bit row exchange, named so that ranks that disagree on it stop in the first key round
    (the row exchange would otherwise meet blocks of another size, named as a routing error)."""
    wire = table.row_dtypes.wire
    return "" if wire == "float32" else f", rows exchanged in {wire}"
