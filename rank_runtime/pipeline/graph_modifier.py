"""Automatic graph modification (the user guide's "Automatic Graph Modification"): ``sparse_lookup(table, ids, ..., modify_graph=True)``
takes a plain id tensor; ``modify_graph_and_start_emb_cache()`` then inserts the key pipeline into
the dataset behind it.

At lookup time the id tensor is traced back to the ``IteratorGetNext`` that produces it; the ops
in between (reshapes, casts, slicing, hashing: anything stateless) are kept as a small GraphDef.
The lookup is built on placeholders that stand for the key pipeline's outputs. Modification then,
for every iterator behind such lookups:

1. rebuilds its dataset from the graph (the ``MakeIterator`` input, or a one-shot iterator's
   dataset factory), maps it to a dict of the old components plus each lookup's ids, computed by
   importing the kept GraphDef inside the map function, and maps that with the same insert
   function FeatureSpec mode uses;
2. makes a new iterator of the same kind and rewires every consumer of the old ``get_next()``
   outputs and of the placeholders to the new ``get_next()``;
3. keeps the new initializers for ``get_initializer(True / False)``, and starts the pipeline.
"""
import os
import re

import tensorflow as tf
from tensorflow.python.data.ops import dataset_ops

from ..process import config
from .feature_spec import FeatureSpec
from .key_pipeline import InsertFunction, start_asc_pipeline
from ..process.logs import get_logger
from . import ragged_ids
from .routing import FeatureRouting, PoolRouting
from ..validation import check_bool

log = get_logger("shardrec.graph_modifier")

_GET_NEXT = ("IteratorGetNext", "IteratorGetNextSync")
_COMPONENT = "_shardrec_component_{}"


class PendingLookup:
    """One modify_graph=True lookup, waiting for modification."""

    def __init__(self, name, table, spec, is_train, ids, get_next, transform_ops, placeholders, pool=None):
        self.name = name
        self.table = table
        self.spec = spec
        self.is_train = is_train
        self.ids = ids
        self.get_next = get_next
        self.transform_ops = transform_ops
        # GraphDef of the ops from get_next outputs to ids (None: ids is a get_next output), cut
        # at modification from one serialisation of the graph for all lookups.
        self.transform = None
        self.placeholders = placeholders
        self.pool = pool  # a variable-length lookup's PoolRouting placeholders; None for dense ids


def _describe(op):
    return f"{op.type} op {op.name!r}"


def _trace_to_iterator(lookup_name, tensors):
    """(the IteratorGetNext op behind `tensors` (the ids, or ragged ids' values and row splits), the
    stateless ops between them)."""
    get_next, between, stack, seen = set(), [], [t.op for t in tensors], set()
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type in _GET_NEXT:
            get_next.add(op)
            continue
        if op.op_def.is_stateful or op.type in ("Placeholder", "PlaceholderWithDefault"):
            raise ValueError(
                f"sparse_lookup {lookup_name!r} (modify_graph=True): its ids must come from a dataset iterator's "
                f"get_next() through stateless ops, but they depend on {_describe(op)}; pass ids computed from "
                "iterator.get_next(), or use FeatureSpec mode")
        between.append(op)
        stack.extend(t.op for t in op.inputs)
    if not get_next:
        found = ", ".join(_describe(op) for op in between[:3]) or _describe(tensors[0].op)
        raise ValueError(f"sparse_lookup {lookup_name!r} (modify_graph=True): its ids do not come from a dataset "
                         f"iterator's get_next(); found {found} instead. Pass ids computed from iterator.get_next(), "
                         "or use FeatureSpec mode")
    if len(get_next) > 1:
        raise ValueError(f"sparse_lookup {lookup_name!r} (modify_graph=True): its ids come from several iterators "
                         f"({', '.join(sorted(op.name for op in get_next))}); one lookup's ids must come from one")
    return get_next.pop(), between


def _transform_graph_def(full, between):
    if not between:
        return None
    names = {op.name for op in between}
    out = tf.compat.v1.GraphDef()
    out.library.CopyFrom(full.library)
    for node in full.node:
        if node.name in names:
            copy = out.node.add()
            copy.CopyFrom(node)
            # Control edges to ops outside the transform (an iterator, a variable) mean nothing in
            # the dataset's map function.
            del copy.input[:]
            copy.input.extend(i for i in node.input if not i.startswith("^") or i[1:] in names)
            # Colocation with an op left outside (a ragged batch's decoding names the batch dataset
            # op) cannot be honoured inside the map function, and means nothing there.
            if "_class" in copy.attr:
                del copy.attr["_class"]
    return out


def _feature_name(ids, table):
    """The feature of a modified lookup, named from the graph (the id tensor and the table), so that
    every rank that builds the same graph names it alike, in whatever order; a second lookup of the
    same ids in the same table gets its number."""
    stem = "_shardrec_mg_" + re.sub(r"[^A-Za-z0-9_.]", "_", ids.name) + "_" + table.table_name
    pending = config.get_config().graph_state(ids.graph).pending_lookups
    n = sum(1 for lookup in pending if re.fullmatch(re.escape(stem) + r"(_\d+)?", lookup.spec.name))
    return stem if n == 0 else f"{stem}_{n}"


def pending_lookup(hashtable, ids: tf.Tensor, is_train: bool, name: str | None,
                   access_and_evict_config: dict | None) -> PendingLookup:
    """Records a modify_graph=True lookup and returns it: its FeatureSpec, and the routing
    placeholders the lookup's graph reads, which modification later rewires to the key pipeline."""
    lookup_name = name or f"{hashtable.table_name}_lookup"
    pooled = ragged_ids.is_variable_length(ids)
    if pooled:
        ids = ragged_ids.as_ragged(ids, f"sparse_lookup {lookup_name!r}: ids")
    elif not isinstance(ids, tf.Tensor):
        raise TypeError(f"sparse_lookup {lookup_name!r}: with modify_graph=True, 'ids' must be an id tensor from "
                        f"iterator.get_next() (dense, ragged or sparse), got {type(ids).__name__}")
    if ids.dtype not in (tf.int32, tf.int64):
        raise TypeError(f"sparse_lookup {lookup_name!r}: ids must be int32 or int64, got {ids.dtype.name}")
    traced = [ids.flat_values, ids.row_splits] if pooled else [ids]
    get_next, between = _trace_to_iterator(lookup_name, traced)
    thresholds = access_and_evict_config or {}
    eviction = thresholds.get("eviction_threshold")
    if is_train and eviction is not None and eviction >= 0:
        raise ValueError(f"sparse_lookup {lookup_name!r}: access_and_evict_config['eviction_threshold'] = "
                         f"{eviction} measures ages in the data's timestamps, which graph "
                         "modification has no timestamp feature to read; evict in FeatureSpec mode (a "
                         "FeatureSpec(..., is_timestamp=True) among get_asc_insert_func's specs), or set "
                         "eviction_threshold=-1 (admission by access_threshold works here)")
    spec = FeatureSpec(_feature_name(traced[0], hashtable), table_name=hashtable.table_name,
                       access_threshold=thresholds.get("access_threshold"),
                       eviction_threshold=thresholds.get("eviction_threshold"))
    size = config.get_config().size
    with tf.name_scope(f"{lookup_name}_pending"):
        placeholders = FeatureRouting.placeholders(size, None if pooled else ids.shape.num_elements())
        pool = PoolRouting.placeholders(size, None) if pooled else None
    pending = PendingLookup(lookup_name, hashtable, spec, is_train, ids, get_next, between, placeholders, pool)
    config.get_config().graph_state(traced[0].graph).pending_lookups.append(pending)
    return pending


def _source_dataset(get_next):
    """(a function that builds the dataset of the iterator behind `get_next`, whether that
    iterator is one-shot)."""
    iterator = get_next.inputs[0].op
    spec = tuple(ragged_ids.component_spec(t) for t in get_next.outputs)
    if iterator.type == "OneShotIterator":
        factory = iterator.get_attr("dataset_factory").name

        def from_factory():
            variant = tf.raw_ops.PartitionedCall(args=[], Tout=[tf.variant], f=factory)[0]
            return dataset_ops._VariantDataset(variant, spec)

        return from_factory, True
    makers = [op for op in iterator.graph.get_operations()
              if op.type == "MakeIterator" and op.inputs[1].op is iterator]
    if iterator.type not in ("IteratorV2", "Iterator") or not makers:
        raise ValueError(f"graph modification: iterator {iterator.name!r} ({iterator.type}) is neither an "
                         "initializable nor a one-shot iterator; make it with tf.compat.v1.data."
                         "make_initializable_iterator or make_one_shot_iterator")
    return lambda: dataset_ops._VariantDataset(makers[0].inputs[0], spec), False


def _ids_in_map_function(lookup, components, specs):
    pooled = lookup.pool is not None
    if lookup.transform is None:  # dense ids straight from get_next (ragged ones are always decoded)
        return components[lookup.ids.value_index]
    used = {t.value_index for op in lookup.transform_ops for t in op.inputs if t.op is lookup.get_next}
    input_map = {f"{lookup.get_next.name}:{k}": ragged_ids.encoded(specs[k], components[k]) for k in used}
    wanted = [lookup.ids.flat_values, lookup.ids.row_splits] if pooled else [lookup.ids]
    found = tf.graph_util.import_graph_def(lookup.transform, input_map=input_map,
                                           return_elements=[t.name for t in wanted], name="ids")
    return tf.RaggedTensor.from_row_splits(*found, validate=False) if pooled else found[0]


def _rewire(old, new):
    for consumer in list(old.consumers()):
        for index, tensor in enumerate(consumer.inputs):
            if tensor is old:
                consumer._update_input(index, new)  # pylint: disable=protected-access


def _modify_iterator(get_next, lookups):
    modes = {lookup.is_train for lookup in lookups}
    if len(modes) > 1:
        raise ValueError(f"graph modification: iterator {get_next.inputs[0].op.name!r} feeds lookups with is_train=True "
                         f"and is_train=False ({', '.join(lk.name for lk in lookups)}); train and eval lookups need "
                         "their own iterators")
    is_train = modes.pop()
    source, one_shot = _source_dataset(get_next)
    specs = [ragged_ids.component_spec(t) for t in get_next.outputs]

    def with_ids(*components):
        element = {_COMPONENT.format(k): c for k, c in enumerate(components)}
        for lookup in lookups:
            element[lookup.spec.name] = _ids_in_map_function(lookup, components, specs)
        return element

    insert = InsertFunction([lk.spec for lk in lookups], is_train)

    def rebuilt():
        return source().map(with_ids).map(insert)

    if one_shot:
        # A one-shot iterator builds its dataset inside a function, which cannot capture the
        # factory's dataset from outside: the whole rebuilt dataset is made inside flat_map.
        dataset = tf.data.Dataset.from_tensors(0).flat_map(lambda _: rebuilt()).prefetch(2)
        iterator = tf.compat.v1.data.make_one_shot_iterator(dataset)
    else:
        iterator = tf.compat.v1.data.make_initializable_iterator(rebuilt().prefetch(2))
    new = iterator.get_next()
    for k, old in enumerate(get_next.outputs):
        _rewire(old, ragged_ids.encoded(specs[k], new[_COMPONENT.format(k)]))
    for lookup in lookups:
        routing = FeatureRouting.read_from(new, lookup.spec.name, config.get_config().size,
                                           lookup.placeholders.restore.shape[0])
        for field in FeatureRouting.names():
            _rewire(getattr(lookup.placeholders, field), getattr(routing, field))
        if lookup.pool is not None:
            pool = PoolRouting.read_from(new, lookup.spec.name)
            for field in PoolRouting.names():
                _rewire(getattr(lookup.pool, field), getattr(pool, field))
        lookup.table.mark_distinct_rows(routing.rows)
    return is_train, (None if one_shot else iterator.initializer)


def _dump(graph, directory, name):
    tf.io.write_graph(graph.as_graph_def(add_shapes=True), directory, name, as_text=True)


def modify_graph_and_start_emb_cache(dump_graph: bool = False) -> None:
    """Inserts the key pipeline behind every modify_graph=True lookup of the default graph, then
    starts the pipeline."""
    check_bool("modify_graph_and_start_emb_cache", "dump_graph", dump_graph)
    cfg = config.get_config()
    graph = tf.compat.v1.get_default_graph()
    state = cfg.graph_state(graph)
    if not state.pending_lookups:
        raise RuntimeError("modify_graph_and_start_emb_cache: this graph has no sparse_lookup(..., modify_graph=True) "
                           "waiting for modification; build the lookups first (or use start_asc_pipeline() in "
                           "FeatureSpec mode)")
    directory = os.path.abspath(os.path.join("graph_dump", f"rank-{cfg.rank}"))
    if dump_graph:
        _dump(graph, directory, "before_modify.pbtxt")
    full = graph.as_graph_def(add_shapes=False)
    groups = {}
    for lookup in state.pending_lookups:
        lookup.transform = _transform_graph_def(full, lookup.transform_ops)
        groups.setdefault(lookup.get_next, []).append(lookup)
    initializers = {True: [], False: []}
    with graph.as_default(), tf.name_scope("shardrec_modified_input"):
        for get_next, lookups in groups.items():
            is_train, initializer = _modify_iterator(get_next, lookups)
            if initializer is not None:
                initializers[is_train].append(initializer)
        for is_train, ops in initializers.items():
            state.initializers[is_train] = tf.group(*ops, name="train_initializer" if is_train else "eval_initializer")
    log.info("graph modified: %d lookup(s) over %d iterator(s) now read the key pipeline",
             len(state.pending_lookups), len(groups))
    state.pending_lookups = []
    if dump_graph:
        _dump(graph, directory, "after_modify.pbtxt")
        log.info("graph before and after modification written to %s (before_modify.pbtxt, after_modify.pbtxt)",
                 directory)
    start_asc_pipeline()


def get_initializer(is_training: bool) -> tf.Operation:
    """The initializer of the iterator(s) that graph modification made for train (True) or eval
    (False) lookups; run it where the script ran iterator.initializer."""
    check_bool("get_initializer", "is_training", is_training)
    state = config.get_config().graph_state()
    if not state.initializers:
        raise RuntimeError("get_initializer: the graph is not modified yet; call modify_graph_and_start_emb_cache() "
                           "(or add GraphModifierHook in Estimator mode) before get_initializer")
    return state.initializers[is_training]
