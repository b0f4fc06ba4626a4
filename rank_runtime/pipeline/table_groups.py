"""Table groups: the lookups of one batch whose tables can share kernels, fused into one row
gather, one row exchange each way and one restore (native/src/tf_ops/tf_group_ops.cc), whatever
the number of tables (issue 71: each table's lookup was its own ops and two MPI rounds a step).

A lookup joins the group of its batch and key: row width, the dtype rows cross in, the channel,
and a lookup path the fused kernels run (dense ids, one row per id, row-wise or table-wise,
dynamic shapes, no dynamic expansion). Models create a table and look it up in turn, so the
group's ops cannot be built at its first lookup: each lookup returns an Identity of a stand-in,
and the group is built (its members in feature name order, the order every rank uses) and the
Identities rewired to it at the first of: a gradient taken in the graph (tf_patches.py wraps
TensorFlow's gradient builder), start_asc_pipeline(). A lookup after that starts a new group.

The tables, their stores, thresholds, tiers, slots and optimizers stay per table: a group only
moves their rows together. The gather reads each table under its own lock and reports its batch
to its own row store; its gradient reaches each table's variable as that table's own
IndexedSlices over its distinct rows, so every optimizer applies per table as before. A member
looked up with is_grad=False only gets no gradient (None, as ungrouped).
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from ..embedding import native_ops
from ..formats.channel import Channel
from ..formats.sharding_plan import COLUMN_WISE, REPLICATED
from ..process import config
from ..process.world import get_world
from . import exchanges
from .routing import FeatureRouting

GroupKey = Tuple[int, str, Channel]  # (row width, exchange dtype, channel)


@dataclass
class _Member:
    feature: str
    table: object
    routing: FeatureRouting
    stand_in: tf.Operation     # the Identity every lookup of the feature returns (rewired when built)
    # The lookup's rows without a group (with a gradient or not; from its rows by address, if any).
    alone: Callable[[bool, Optional[tf.Tensor]], tf.Tensor]
    # Dynamic expansion's training lookups: the table's distinct rows read by address, made at the
    # lookup (scripts take gradients of them from a collection before any gradient builds the
    # group); None: the group reads the table itself.
    by_address: Optional[tf.Tensor] = None
    with_gradient: bool = False


@dataclass
class LookupGroup:
    """One batch's fused lookup."""
    key: GroupKey
    members: List[_Member] = field(default_factory=list)
    built: bool = False

    @property
    def features(self) -> List[str]:
        return [m.feature for m in self.members]

    @property
    def tables(self) -> list:
        return [m.table for m in self.members]

    @property
    def fused(self) -> bool:
        """Built as a group (more than one table), not as its one lookup alone."""
        return self.built and len(self.members) > 1

    def describe(self) -> str:
        dim, wire, channel = self.key
        return (f"{channel.label} group of {len(self.members)} table(s), dim {dim}, rows in {wire}: "
                + ", ".join(f"{m.table.table_name} ({m.feature})" for m in self.members))


@dataclass
class _GraphGroups:
    """A graph's groups: those still taking lookups by (batch, key), every group in order, and the
    built ones by their gather op (for its gradient)."""
    open: Dict[Tuple[str, GroupKey], LookupGroup] = field(default_factory=dict)
    groups: List[LookupGroup] = field(default_factory=list)
    by_gather: Dict[str, LookupGroup] = field(default_factory=dict)


@dataclass
class _GroupsByGraph:
    graphs: exchanges.PerGraph[_GraphGroups] = field(default_factory=lambda: exchanges.PerGraph(_GraphGroups))


_STATE = _GroupsByGraph()


def _groups(graph: tf.Graph) -> _GraphGroups:
    return _STATE.graphs.of(graph)


def groups_of(graph: tf.Graph) -> List[LookupGroup]:
    """The graph's lookup groups, in the order they formed."""
    return list(_groups(graph).groups)


def _key(cfg: config.RuntimeConfig, table, channel: Channel) -> Optional[GroupKey]:
    """The table's group key, or None where its lookup takes a path of its own: one rank (below), a
    replicated or column-wise table (its rows are read and joined otherwise), static shapes (padded
    routings)."""
    kind = table.placement.kind
    # One rank has no exchange to save, and there a group cost more CPU than its tables alone (104
    # tables of 1,024 ids: 147 against 127 ns per id, bench/table_groups.py): the tables' rows went
    # through a buffer of all of them and their updates came after every table's read, out of cache.
    if not cfg.table_groups or cfg.size == 1 or not cfg.use_dynamic or kind in (REPLICATED, COLUMN_WISE):
        return None
    return (table.row_dim, table.row_dtypes.wire, channel)


def member_rows(table, feature: str, routing: FeatureRouting, channel: Channel, is_grad: bool,
                alone: Callable[[bool, Optional[tf.Tensor]], tf.Tensor],
                distinct: Optional[Callable[[bool], tf.Tensor]] = None) -> Optional[tf.Tensor]:
    """The rows of `feature` (a dense, one-row-per-id lookup of `table` in FeatureSpec mode, whose
    batch filed `routing`) in batch order, from its batch's group; None where the table is not
    grouped (the caller looks it up alone). A group that ends with one member builds `alone`: a
    one-table model's step stays the lookup's own (the group's kernels cost it 10%). `distinct`, for
    a lookup that reads its rows by address, reads them (with a gradient or not): the group moves those."""
    key = _key(config.get_config(), table, channel)
    if key is None:
        return None
    groups = _groups(routing.rows.graph)
    batch = routing.batch
    group = groups.open.get((batch, key))
    if group is None:
        group = groups.open[(batch, key)] = LookupGroup(key)
        groups.groups.append(group)
    member = next((m for m in group.members if m.feature == feature), None)
    if member is None:
        member = _Member(feature, table, routing, _stand_in(feature, key[0]), alone)
        group.members.append(member)
    if distinct is not None and (member.by_address is None or is_grad and not member.with_gradient):
        member.by_address = distinct(is_grad)
    member.with_gradient |= is_grad
    return member.stand_in.outputs[0]


def _stand_in(feature: str, dim: int) -> tf.Operation:
    """What a grouped lookup returns until its group is built: an Identity that fails, if run,
    saying what was missed (build() rewires its input and drops the check)."""
    with tf.name_scope("table_group_member"):
        check = tf.debugging.Assert(tf.constant(False), [
            f"sparse_lookup of feature {feature!r}: its table group is built by the first gradient taken in the "
            "graph or by start_asc_pipeline(); call start_asc_pipeline() after building the graph and before "
            "running it"])
        pending = tf.compat.v1.placeholder_with_default(tf.zeros([0, dim]), [None, dim], name="pending")
        with tf.control_dependencies([check]):
            return tf.identity(pending, name="rows").op


def build(graph: tf.Graph) -> None:
    """Builds the graph's open groups and rewires their lookups to them (before a gradient is
    taken, and at the pipeline's start)."""
    groups = _groups(graph)
    if not groups.open:
        return
    if graph.finalized:
        features = sorted(m.feature for g in groups.open.values() for m in g.members)
        raise RuntimeError(f"start_asc_pipeline: the graph is finalized (a MonitoredSession was created) before the "
                           f"table groups of features {features} were built; call start_asc_pipeline() before "
                           "creating the session, or set SHARDREC_TABLE_GROUPS=off")
    with graph.as_default():
        for group in list(groups.open.values()):
            _build(groups, group)
    groups.open.clear()


def _build(groups: _GraphGroups, group: LookupGroup) -> None:
    if len(group.members) == 1:
        member = group.members[0]
        _rewire(groups, group, [member.alone(member.with_gradient, member.by_address)], None)
        return
    group.members.sort(key=lambda m: m.feature)
    routings = [m.routing for m in group.members]
    channel, wire = group.key[2], group.key[1]
    variables = [m.table.variable for m in group.members]
    with tf.name_scope(f"table_group_{groups.groups.index(group)}"):
        if group.members[0].by_address is not None:
            # Each table's rows by address (and their gradients) stay the lookup's own tensors.
            rows, send_splits = native_ops.group_rows_gather(
                [m.by_address for m in group.members], [r.expand for r in routings], [r.send_splits for r in routings])
        else:
            for m in group.members:
                m.table.mark_distinct_rows(m.routing.rows)
            rows, send_splits = native_ops.group_row_gather(
                variables, [r.rows for r in routings], [r.expand for r in routings],
                [r.send_splits for r in routings], [r.ticket for r in routings], int(channel))
        # Named after its first member (a group of one as that lookup alone); ranks pair a group's
        # communicators by its place, not its name (channel.ExchangeNames).
        first = group.members[0]
        exchange = exchanges.of_graph().row_exchange(first.table.table_name, tuple(group.features), channel, wire,
                                                   len(group.members))
        recv_splits = tf.add_n([r.recv_splits for r in routings]) if len(routings) > 1 else routings[0].recv_splits
        rows = native_ops.row_alltoall(rows, send_splits, recv_splits, exchange.name.rows,
                                       get_world().exchange_timeout_s, exchange.name.gradients, wire)
        outputs = native_ops.group_restore(rows, [r.recv_splits for r in routings], [r.restore for r in routings])
    _rewire(groups, group, outputs, send_splits.op.name)


def _rewire(groups: _GraphGroups, group: LookupGroup, outputs: list, gather: Optional[str]) -> None:
    """The members' lookups now read `outputs`; `gather` (the op that reads the tables) finds the
    group for its gradient."""
    for m, out in zip(group.members, outputs):
        m.stand_in._update_input(0, out)  # noqa: SLF001 - TensorFlow's way to rewire an op's input
        m.stand_in._remove_all_control_inputs()  # noqa: SLF001 - the check that it was built
    group.built = True
    if gather is not None:
        groups.by_gather[gather] = group


@tf.RegisterGradient("ShardrecGroupRowGather")
def _group_row_gather_grad(op, grad, _splits_grad):
    """Each member table's IndexedSlices over its distinct rows; None for a member that no gradient
    lookup read (its variable then has no gradient, as ungrouped)."""
    n = op.get_attr("N")
    index, expand, send = op.inputs[n:2 * n], op.inputs[2 * n:3 * n], op.inputs[3 * n:4 * n]
    # After the forward gather: the update must not overtake the read (a loss linear in the rows
    # has a gradient that depends on none of them).
    with tf.control_dependencies([op.outputs[0]]):
        sums = native_ops.group_row_gather_grad(grad, list(index), list(expand), list(send))
    used = _used(op, n)
    slices = [native_ops.table_slices(op.inputs[t], sums[t], index[t]) if used[t] else None for t in range(n)]
    return slices + [None] * (4 * n)


@tf.RegisterGradient("ShardrecGroupRowsGather")
def _group_rows_gather_grad(op, grad, _splits_grad):
    """Each member's gradient of its distinct rows (which reach its table as its lookup's alone)."""
    n = op.get_attr("N")
    expand, send = op.inputs[n:2 * n], op.inputs[2 * n:3 * n]
    group = _groups(op.graph).by_gather[op.name]
    with tf.control_dependencies([op.outputs[0]]):
        sums = native_ops.group_row_gather_grad(grad, [m.routing.rows for m in group.members], list(expand),
                                                list(send))
    return [s if m.with_gradient else None for s, m in zip(sums, group.members)] + [None] * (2 * n)


def _used(op, n: int) -> List[bool]:
    """Which members of the group whose table reader is `op` a gradient lookup read."""
    group = _groups(op.graph).by_gather.get(op.name)
    return [True] * n if group is None else [m.with_gradient for m in group.members]


def group_of(graph: tf.Graph, feature: str, channel: Channel) -> str:
    """The groups `feature` is looked up in on `channel` (by their first features; "" where alone):
    the key round's feature signature carries it, so ranks whose groups differ stop in the first
    round naming the feature."""
    return ",".join(sorted({g.members[0].feature for g in _groups(graph).groups
                            if g.fused and g.key[2] == channel and feature in g.features}))


def grouped_features(graph: tf.Graph) -> List[Tuple[str, Channel]]:
    """(feature, channel) of every lookup the graph's built groups hold."""
    return sorted({(m.feature, g.key[2]) for g in _groups(graph).groups if g.fused for m in g.members})


def describe(graph: tf.Graph) -> str:
    """One line per group of more than one table, for the log beside the sharding plan."""
    grouped = [g for g in groups_of(graph) if g.fused]
    if not grouped:
        return ""
    return "lookup groups (SHARDREC_TABLE_GROUPS=off or init(table_groups=False) looks each table up alone):\n" + \
        "\n".join(f"  group {i}: {g.describe()}" for i, g in enumerate(grouped))
