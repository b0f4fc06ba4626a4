"""A new table's placement (formats/sharding_plan.py), decided when create_table makes it: from its
own sharding= (and sharding_rank=), else from init(sharding_plan=)'s plan, else, with
sharding_plan="auto", by the planner (planner.py) given the tables made before it, else row-wise.
A table of a sharding group made after another of the group takes that one's placement (given
constraints must agree with it). The same on every rank: each rank makes the same tables in the
same order from the same inputs.

A replicated table's rows start the same on every rank: drawn from the table's name (and the
initializer's seed), not from TensorFlow's per-process random state, so that the replicas are
equal before the first step as after every step.
"""
import dataclasses

import psutil
import tensorflow as tf

from ..formats.sharding_plan import (COLUMN_WISE, REPLICATED, ROW_WISE, TABLE_WISE, Placement, PlanError,
                                     ShardingPlan, TablePlan, check_group)
from ..process.config import RuntimeConfig
from ..process.world import get_world
from .planner import CostModel, Loads, TableShape, table_cost
from .row_store import row_init


def placement_of(cfg: RuntimeConfig, name: str, sharding: object, rank: object, rows: int, dim: int,
                 row_bytes: int, group: object = None, ssd: bool = False, wire_bytes: int = 4) -> TablePlan:
    """The plan entry of table `name` (`rows` rows of `dim`, `row_bytes` bytes a row, of sharding
    group `group` or of none, with an SSD tier or not)."""
    check_group(name, group)
    if sharding is None and rank is not None:
        raise PlanError(f"table {name!r}: sharding_rank={rank!r} places a table-wise table (or a column-wise one, on "
                        f"a list of ranks); give sharding={TABLE_WISE!r} (or {COLUMN_WISE!r}) with it")
    given = Placement.checked(name, sharding, rank, cfg.size) if sharding is not None else None
    plan = cfg.sharding_plan
    planned = plan.tables.get(name) if plan is not None else None
    if plan is not None:
        if planned is None:
            raise PlanError(f"table {name!r}: the sharding plan does not place it; it places "
                            f"{sorted(plan.tables)}. Add the table to the plan (or give create_table sharding=)")
        if None not in (planned.group, group) and planned.group != group:
            raise PlanError(f"table {name!r}: the sharding plan puts it in sharding group {planned.group!r}, "
                            f"create_table in {group!r}; give the same group (or none) to one of them")
        group = group if group is not None else planned.group
    if given is not None and planned is not None and not _agree(planned.placement, given):
        raise PlanError(f"table {name!r}: sharding={given.describe()!r} disagrees with the sharding plan's "
                        f"{planned.placement.describe()!r}; give one of them")
    shape = TableShape(name, rows, dim, row_bytes, cfg.graph_state().ids_per_step(name), sharding=sharding,
                       rank=rank, ssd=ssd, wire_bytes=wire_bytes)
    earlier = sorted((other, t.plan.placement) for other, t in cfg.tables.items()
                     if group is not None and t.plan.group == group)
    if earlier:  # the group is placed: this table joins it
        first, placement = earlier[0]
        for by, constraint in (("sharding=", given), ("the sharding plan's", planned and planned.placement)):
            if constraint is not None and not _agree(placement, constraint):
                raise PlanError(f"table {name!r}: {by} {constraint.describe()!r}, but sharding group {group!r} "
                                f"placed table {first!r} {placement.describe()} and a group's tables share one "
                                "placement; give them one placement, or take the table out of the group")
        return TablePlan(placement, table_cost(shape, placement, cfg.size, CostModel()), "group", group)
    if given is not None and (given.kind not in (TABLE_WISE, COLUMN_WISE) or given.rank is not None):
        entry = TablePlan(given, None, "user")
    elif given is not None:
        entry = _loads(cfg).place(shape, CostModel(), "user")  # the least loaded rank(s)
    elif planned is not None:
        entry = TablePlan(planned.placement, planned.cost, planned.chosen_by)
    elif cfg.sharding_auto:
        entry = _loads(cfg).place(shape, CostModel())
    else:
        entry = TablePlan(Placement(ROW_WISE), None, "default")
    return dataclasses.replace(entry, group=group)


def _agree(planned: Placement, given: Placement) -> bool:
    return planned.kind == given.kind and (given.rank is None or (planned.rank, planned.slices) ==
                                           (given.rank, given.slices))


def _loads(cfg: RuntimeConfig) -> Loads:
    """Each rank's load from the tables of this graph made so far (those the planner estimated),
    within a memory budget of half the host's memory shared by the host's ranks."""
    loads = Loads(cfg.size, psutil.virtual_memory().total // 2 // max(1, get_world().local_size))
    for table in cfg.tables.values():
        cost = table.plan.cost
        if cost is not None and len(cost.seconds) == cfg.size:
            loads.seconds += cost.seconds
            loads.memory += cost.memory
    return loads


def check_placement(owner: str, name: str, placement: Placement, ssd: bool, dim: int) -> None:
    """What a placement cannot be combined with, refused naming the table."""
    placement.check_dim(name, dim)
    if placement.kind == COLUMN_WISE and ssd:
        raise PlanError(f"{owner}: table {name!r}: a column-wise table has no SSD tier (its slices are joined into "
                        f"whole rows on every save, from memory); allowed with ssd_vocabulary_size > 0: "
                        f"sharding={ROW_WISE!r} or {TABLE_WISE!r}")
    if placement.kind == REPLICATED and ssd:
        raise PlanError(f"{owner}: table {name!r}: a replicated table has no SSD tier (each rank would keep a copy of "
                        f"every row on its own disk); allowed with ssd_vocabulary_size > 0: sharding={ROW_WISE!r} or "
                        f"{TABLE_WISE!r}")


def replica_initial(emb_initializer, name: str, shape: list, init_param: float) -> tf.Tensor:
    """A replicated table's initial values: the initializer's distribution, drawn by stateless ops from
    the table's name, the same on every rank (an initializer the native core cannot draw for is a
    ValueError naming those it can)."""
    init = row_init(emb_initializer, name, 0, "for a replicated table (every rank draws the same rows)",
                    per_rank=False)
    seed = tf.constant([init.seed & 0x7FFFFFFF, (init.seed >> 31) & 0x7FFFFFFF], tf.int64)
    if init.kind == 0:
        values = tf.fill(shape, tf.constant(init.a, tf.float32))
    elif init.kind == 1:
        values = tf.random.stateless_uniform(shape, seed, minval=init.a, maxval=init.b)
    elif init.kind == 2:
        values = tf.random.stateless_normal(shape, seed, mean=init.a, stddev=init.b)
    else:
        values = tf.random.stateless_truncated_normal(shape, seed, mean=init.a, stddev=init.b)
    return values * tf.constant(init_param, tf.float32)



def job_plan(cfg: RuntimeConfig, tables: dict) -> ShardingPlan:
    """The plan of this graph's `tables` ({name: EmbeddingTable}) as they are placed, each estimate
    made again from what is known now (every feature's ids per batch, each row's bytes with its
    optimizer slots); a plan given to init() must name exactly these tables. Each table keeps its
    entry (table.plan), which its checkpoint then holds."""
    if cfg.sharding_plan is not None:
        cfg.sharding_plan.check_tables(list(tables))
    state = cfg.graph_state()
    entries = {}
    for name, table in sorted(tables.items()):
        shape = TableShape(name, table.vocabulary_rows, table.dim,
                           table.store.bytes_per_row, state.ids_per_step(name))
        entry = TablePlan(table.placement, table_cost(shape, table.placement, cfg.size, CostModel()),
                          table.plan.chosen_by, table.plan.group)
        table.plan = entry
        entries[name] = entry
    return ShardingPlan(cfg.size, entries)
