"""sparse_lookup: rows of a sharded table for the ids of one feature, in batch order."""
import tensorflow as tf

from ..process import config
from ..embedding import export_view, native_ops
from ..formats.channel import Channel
from ..formats.sharding_plan import REPLICATED
from .feature_spec import FeatureSpec
from .graph_modifier import pending_lookup
from ..optimizers import by_address
from . import combiners, exchanges, pooled_lookup, ragged_ids, table_groups
from .exchanges import RowExchange
from .routing import FeatureRouting, PoolRouting
from ..embedding.table import EmbeddingTable
from ..validation import INT32_MAX, check_bool, check_int, check_type
from ..process.world import get_world

_OWNER = "sparse_lookup"


def _routing(spec, batch):
    if batch is None:
        raise ValueError(f"{_OWNER}: feature {spec.name!r}: pass batch= (the dataset element from "
                         "iterator.get_next()) so the lookup can read the rows the key pipeline prepared")
    check_type(_OWNER, "batch", batch, dict, "the dict from iterator.get_next()")
    ids = batch.get(spec.index_key)
    per_batch = ids.shape.num_elements() if isinstance(ids, tf.Tensor) else None  # ragged ids: unknown
    routing = FeatureRouting.read_from(batch, spec.name, config.get_config().size, per_batch)
    if routing is None:
        raise ValueError(f"{_OWNER}: feature {spec.name!r} was not processed by the key pipeline: map the "
                         "dataset with get_asc_insert_func(tgt_key_specs=[...this FeatureSpec...]) first")
    if spec.index_key not in batch:
        raise ValueError(f"{_OWNER}: feature {spec.name!r}: batch has no ids under {spec.index_key!r}")
    return routing


def _one_spec(ids):
    """Seed 003 passes its list of FeatureSpecs; the Rec SDK's lookup takes one."""
    if isinstance(ids, (list, tuple)) and all(isinstance(s, FeatureSpec) for s in ids):
        if len(ids) != 1:
            raise ValueError(f"{_OWNER}: 'ids' is a list of {len(ids)} FeatureSpecs "
                             f"({', '.join(repr(s.name) for s in ids)}); a lookup takes one: call sparse_lookup "
                             "once per FeatureSpec")
        return ids[0]
    return ids


def _check_thresholds(spec, access_and_evict_config):
    """In FeatureSpec mode the spec's thresholds govern; a config dict must say the same."""
    for key in ("access_threshold", "eviction_threshold"):
        given = access_and_evict_config.get(key)
        on_spec = getattr(spec, key)
        # None and -1 both mean "off".
        if (-1 if given is None else given) != (-1 if on_spec is None else on_spec):
            raise ValueError(f"{_OWNER}: access_and_evict_config[{key!r}] = {given} disagrees with FeatureSpec "
                             f"{spec.name!r}'s {key} = {on_spec}; in FeatureSpec mode the FeatureSpec's thresholds "
                             "govern: make them agree, or leave access_and_evict_config out")


def _rows_to_requesters(rows, send_splits, recv_splits, dim, static_rows, exchange: RowExchange):
    """Owner -> requester: each rank gets back the rows of the keys it sent, owner by owner, on the
    lookup's own communicators (the op library's row exchange; gradients go back the same way, both
    in the table's exchange dtype). They are made when the pipeline starts (world.make_row_exchanges),
    matched by name."""
    back = native_ops.row_alltoall(rows, send_splits, recv_splits, exchange.name.rows,
                                   get_world().exchange_timeout_s, exchange.name.gradients, exchange.wire)
    back.set_shape([static_rows, dim])
    return back


def _own_rows(cfg, rows, routing, exchange: RowExchange):
    """A replicated table: every rank holds every row, so a rank reads its own keys' rows from its
    own replica (its block among the keys every rank received) and nothing crosses forward. Each
    replica must learn every rank's gradients, as a row-wise owner does from its requesters: the
    gradient of this rank's block goes to every rank (the block repeated once per rank on the
    lookup's gradient communicator), landing where that rank's keys sit among those received."""
    begin = tf.cumsum(routing.send_splits, exclusive=True)[cfg.rank]
    size = routing.send_splits[cfg.rank]
    timeout = get_world().exchange_timeout_s

    @tf.custom_gradient
    def own_block(received):
        def grad(dy):
            every_rank = tf.tile(dy, [cfg.size, 1])
            return native_ops.row_alltoall(every_rank, routing.recv_splits, routing.send_splits,
                                           exchange.name.gradients, timeout, wire=exchange.wire)
        return tf.slice(received, tf.stack([begin, 0]), tf.stack([size, -1])), grad

    return own_block(rows)


def _row_exchange(table, spec, channel: Channel, wire: "str | None" = None) -> RowExchange:
    """A new row exchange of this lookup, in `wire` (default: the table's exchange dtype)."""
    return exchanges.of_graph().row_exchange(table.table_name, (spec.name,), channel, wire or table.row_dtypes.wire)


def _check_parameters(cfg, hashtable, send_count, dim, is_train, name, modify_graph, access_and_evict_config,
                      is_grad, kwargs):
    """Every parameter's type and range; returns send_count checked (None with dynamic shapes)."""
    check_type(_OWNER, "hashtable", hashtable, EmbeddingTable, "a table from create_table")
    if hashtable.graph is not tf.compat.v1.get_default_graph():
        raise ValueError(f"{_OWNER}: table {hashtable.table_name!r} was created in another TensorFlow graph; "
                         "create tables in the graph that looks them up (in Estimator mode: call create_table "
                         "inside model_fn, which runs in the Estimator's own graph)")
    check_bool(_OWNER, "modify_graph", modify_graph)
    check_bool(_OWNER, "is_train", is_train)
    check_bool(_OWNER, "is_grad", is_grad)
    if send_count is not None:
        send_count = check_int(_OWNER, "send_count", send_count, 1, INT32_MAX)
    elif not cfg.use_dynamic:
        raise ValueError(f"{_OWNER}: parameter 'send_count' is required with static shapes (init(use_dynamic=False)); "
                         f"allowed: an int in [1, {INT32_MAX}]")
    if dim is not None:
        if isinstance(dim, tf.TensorShape):
            dim = dim[0] if dim.rank == 1 else dim
        check_int(_OWNER, "dim", dim, hashtable.dim, hashtable.dim)
    if name is not None:
        check_type(_OWNER, "name", name, str, "a string")
    if access_and_evict_config is not None:
        check_type(_OWNER, "access_and_evict_config", access_and_evict_config, dict,
                   "a dict with 'access_threshold' and 'eviction_threshold'")
        unknown = set(access_and_evict_config) - {"access_threshold", "eviction_threshold"}
        if unknown:
            raise ValueError(f"{_OWNER}: access_and_evict_config has unknown key(s) {sorted(unknown)}; "
                             "allowed: 'access_threshold', 'eviction_threshold'")
        for key in ("access_threshold", "eviction_threshold"):
            if access_and_evict_config.get(key) is not None:
                check_int(_OWNER, f"access_and_evict_config[{key!r}]", access_and_evict_config[key], -1, INT32_MAX)
    if kwargs:
        raise TypeError(f"{_OWNER}: unknown parameter(s) {sorted(kwargs)}")
    return send_count


def sparse_lookup(hashtable, ids, send_count=None, dim=None, is_train=True, name=None, modify_graph=False,
                  batch=None, access_and_evict_config=None, is_grad=True, serving_default_value=None,
                  combiner=None, weights=None, **kwargs) -> tf.Tensor:
    """Looks up `ids` in `hashtable`; returns a float32 tensor of shape ids.shape + [dim], or, for
    variable-length ids (a RaggedTensor or SparseTensor [batch, (ids)]), [batch, dim]: each
    example's rows combined by `combiner` ('sum', 'mean' (default), 'sqrtn') with optional per-id
    `weights`, as tf.nn.embedding_lookup_sparse, pooled on the owners (pooled_lookup.py)."""
    export = export_view.view_of()
    if export is not None:  # a graph a serving export builds: a stock lookup of the receiver's ids
        return export.lookup(hashtable, ids, batch, serving_default_value, name, combiner, weights)
    cfg = config.get_config()
    send_count = _check_parameters(cfg, hashtable, send_count, dim, is_train, name, modify_graph,
                                   access_and_evict_config, is_grad, kwargs)
    hashtable.add_lookup(_OWNER)
    if cfg.graph_state().pipeline_started:
        raise RuntimeError(f"{_OWNER}: the key pipeline is already started; build every lookup before "
                           "start_asc_pipeline()")
    if modify_graph:
        pending = pending_lookup(hashtable, ids, is_train, name, access_and_evict_config)
        ids, routing, ids_tensor, pool = pending.spec, pending.placeholders, pending.ids, pending.pool
    else:
        ids, routing, ids_tensor, pool = _spec_lookup(hashtable, ids, batch, access_and_evict_config)
    combiner = combiners.check_combiner(combiner, pool is not None)
    channel = Channel.of(is_train)
    if send_count is not None:
        exchanges.of_graph().ask(ids.name, channel, send_count=send_count)
    if pool is not None:
        return _pooled(cfg, hashtable, ids, routing, pool, ids_tensor, weights, combiner, channel, is_grad,
                       serving_default_value, name)
    if weights is not None:
        raise ValueError(f"{_OWNER}: parameter 'weights' weighs variable-length ids (a RaggedTensor or "
                         "SparseTensor) in their combination; these ids are dense: leave weights out")
    with tf.name_scope(name or f"{hashtable.table_name}_lookup"):
        emb = None
        if not modify_graph and serving_default_value is None:
            reads_by_address = cfg.use_dynamic_expansion and channel == Channel.TRAIN
            emb = table_groups.member_rows(
                hashtable, ids.name, routing, channel, is_grad,
                lambda with_gradient, distinct: _rows_of_batch(cfg, hashtable, ids, routing, channel, send_count,
                                                               with_gradient, None, distinct),
                (lambda with_gradient: _distinct_rows(cfg, hashtable, routing, channel, with_gradient))
                if reads_by_address else None)
            if emb is not None and not is_grad:
                emb = tf.stop_gradient(emb)
        if emb is None:
            emb = _rows_of_batch(cfg, hashtable, ids, routing, channel, send_count, is_grad, serving_default_value)
        shape = ids_tensor.shape.concatenate([hashtable.dim])
        if shape.is_fully_defined():  # one op, where the shape read from the ids is three a step
            return tf.reshape(emb, shape.as_list())
        out = tf.reshape(emb, tf.concat([tf.shape(ids_tensor, out_type=tf.int32), [hashtable.dim]], 0))
        out.set_shape(shape)
        return out


def _spec_lookup(hashtable, spec, batch, access_and_evict_config):
    """FeatureSpec mode: (the spec, its routing, its ids from the batch, its pooled routing or None)."""
    if ragged_ids.is_variable_length(spec):
        raise TypeError(f"{_OWNER}: 'ids' is a {type(spec).__name__}, which needs modify_graph=True (ids from "
                        "iterator.get_next()); without graph modification pass the FeatureSpec whose dataset key "
                        "holds the variable-length ids")
    spec = _one_spec(spec)
    check_type(_OWNER, "ids", spec, FeatureSpec, "a FeatureSpec (or, with modify_graph=True, an id tensor)")
    if spec.table_name != hashtable.table_name:
        raise ValueError(f"{_OWNER}: feature {spec.name!r} belongs to table {spec.table_name!r}, "
                         f"not to {hashtable.table_name!r}")
    if access_and_evict_config is not None:
        _check_thresholds(spec, access_and_evict_config)
    routing = _routing(spec, batch)
    ids = batch[spec.index_key]
    pool = PoolRouting.read_from(batch, spec.name)
    if ragged_ids.is_variable_length(ids) and pool is None:
        raise ValueError(f"{_OWNER}: feature {spec.name!r}: its ids are variable-length but the key pipeline did "
                         "not pool them; map the dataset with get_asc_insert_func after batching it")
    return spec, routing, ids, pool


def _pooled(cfg, table, spec, routing, pool, ids, weights, combiner, channel, is_grad, serving_default_value, name):
    if serving_default_value is not None:
        raise ValueError(f"{_OWNER}: serving_default_value applies to lookups of one row per id; a pooled lookup "
                         "(variable-length ids) reads a missing id's row as zeros: leave it out")
    if table.placement.kind == REPLICATED and cfg.size > 1:
        return _pooled_by_requester(cfg, table, spec, routing, ids, weights, combiner, channel, is_grad, name)
    if weights is not None:
        exchanges.of_graph().ask(spec.name, channel, weighted=True)

    def exchange(rows, send_splits, recv_splits, wire=table.row_dtypes.wire):
        return _rows_to_requesters(rows, send_splits, recv_splits, rows.shape[-1], None,
                                   _row_exchange(table, spec, channel, wire))

    with tf.name_scope(name or f"{table.table_name}_lookup"):
        ragged = ragged_ids.as_ragged(ids)
        rows = _distinct_rows(cfg, table, routing, channel, is_grad)
        emb = pooled_lookup.pooled_rows(cfg.size, rows, pool, ragged, combiners.checked_weights(weights, ragged),
                                        combiner, exchange, table.placement.native_slices)
        emb.set_shape([ragged.shape[0], table.dim])
        return emb


def _pooled_by_requester(cfg, table, spec, routing, ids, weights, combiner, channel, is_grad, name):
    """A replicated table's variable-length ids: the key round routed them as any ids (no pooling
    round), every row is on this rank, so it pools its own examples: its ids' rows from its own
    replica (_own_rows), weighted and combined per example as tf.nn.embedding_lookup_sparse."""
    with tf.name_scope(name or f"{table.table_name}_lookup"):
        ragged = ragged_ids.as_ragged(ids)
        rows = _rows_asked_for(cfg, table, routing, channel, is_grad, None)
        own = _own_rows(cfg, rows, routing, _row_exchange(table, spec, channel))
        per_id = native_ops.row_gather(own, routing.restore)
        emb = combiners.combine_rows(per_id, ragged, combiners.checked_weights(weights, ragged), combiner)
        emb.set_shape([ragged.shape[0], table.dim])
        return emb


def _distinct_rows(cfg, table, routing, channel, is_grad, expand=None):
    """The owner's first stage, for every kind of lookup: the batch's distinct rows of its shard
    (with `expand`, those rows as each requester asked for them, in one gather from the table).
    Gradients flow to the table variable as IndexedSlices over `routing.rows`, which are distinct:
    the sparse optimizers update those rows only, with no dedup of their own; the stages after
    this one sum the gradients of a row asked for several times."""
    rows = native_ops.variable_row_gather(table.variable, routing.rows, routing.ticket, channel, expand)
    table.mark_distinct_rows(routing.rows)
    if not is_grad:
        return tf.stop_gradient(rows)
    if cfg.use_dynamic_expansion and channel == Channel.TRAIN:
        by_address.record_lookup(table, rows, tf.cast(routing.rows, tf.int64, name="id_offset"))
    return rows


def _rows_asked_for(cfg, table, routing, channel, is_grad, serving_default_value, distinct=None):
    """The rows the requesters asked for, on the owner, in the order the row exchange sends them;
    with serving_default_value, one more column that is 1 where the key has no row. `distinct`:
    dynamic expansion's distinct rows, read already."""
    # Dynamic expansion's local rows are the distinct rows (by_address.py): gathered, then expanded.
    needs_expand = cfg.size > 1 or not cfg.use_dynamic
    expanded = needs_expand and not (cfg.use_dynamic_expansion and channel == Channel.TRAIN)
    rows = distinct if distinct is not None else \
        _distinct_rows(cfg, table, routing, channel, is_grad, routing.expand if expanded else None)
    if serving_default_value is not None:
        # The owner knows which keys have no row: that flag travels back as one more column.
        missing = tf.cast(tf.equal(routing.rows, table.sentinel), tf.float32)[:, None]
        if expanded:
            missing = native_ops.row_gather(missing, routing.expand)
        rows = tf.concat([rows, missing], axis=1)
    if needs_expand and not expanded:
        rows = native_ops.row_gather(rows, routing.expand)
    return rows


def _rows_of_batch(cfg, table, spec, routing, channel, send_count, is_grad, serving_default_value, distinct=None):
    """The stages of a lookup (docs/internals/step.md): row gather on the owner, the row
    exchange back to the requesters, restore to batch order."""
    rows = _rows_asked_for(cfg, table, routing, channel, is_grad, serving_default_value, distinct)
    width = table.row_dim + (serving_default_value is not None)
    if not cfg.use_dynamic:
        rows = tf.ensure_shape(rows, [send_count * cfg.size, width])
    if cfg.size > 1:
        exchange = _row_exchange(table, spec, channel)
        if table.placement.kind == REPLICATED:
            rows = _own_rows(cfg, rows, routing, exchange)
        else:
            rows = _rows_to_requesters(rows, routing.send_splits, routing.recv_splits, width,
                                       None if cfg.use_dynamic else send_count * cfg.size, exchange)
    emb = _slices_joined(table, rows, routing) if table.placement.native_slices > 1 else \
        native_ops.row_gather(rows, routing.restore)
    if serving_default_value is not None:
        default = tf.broadcast_to(tf.cast(serving_default_value, tf.float32), [table.dim])
        emb, missing = emb[:, :table.dim], emb[:, table.dim:] > 0.5
        emb = tf.where(missing, default[None, :], emb)
    return emb


def _slices_joined(table, rows, routing):
    """A column-wise table's rows per id. Each slice rank returned the same unique ids in the same
    order (the key round sent them all to each), one block after the other from the first slice's
    on, each as long as the first (`recv_splits`; padded ones with static shapes): the blocks are set
    side by side once per unique id, [k, u, w] to [u, k x w] (the missing-key column of
    serving_default_value once, after them), and only then gathered per id, as any table's rows."""
    k, width = table.placement.native_slices, table.row_dim
    first = table.placement.native
    base = tf.reduce_sum(routing.recv_splits[:first])
    block = routing.recv_splits[first]
    blocks = tf.reshape(rows[base:base + k * block], [k, -1, rows.shape[-1]])
    side_by_side = tf.transpose(blocks, [1, 0, 2])
    joined = tf.reshape(side_by_side[:, :, :width], [-1, k * width])
    if rows.shape[-1] != width:
        joined = tf.concat([joined, side_by_side[:, 0, width:]], axis=1)
    return native_ops.row_gather(joined, routing.restore - base)
