"""The sharding planner: each table placed where it costs least, by a cost model of what a training
step moves and does per rank, so that the most loaded rank's cost is as small as it can be made.

Like TorchRec's planner (enumerate the placements of each table, estimate each one's cost and
memory, then place tables so as to minimise the most loaded rank) with the placements shardrec
has: row-wise (keys spread by key mod world size), table-wise (every key on one rank),
replicated (every rank holds the table; lookups stay local, each rank's gradients go to every
rank) and column-wise (the row's columns split over k consecutive ranks, each holding every key).
Pure Python on a few numbers per table: a plan for 1,000 tables takes a fraction of a second, the
same on every rank (no collective needed: the inputs are the same everywhere).

The cost of one table under one placement, per rank and training step (formats/sharding_plan.py's
TableCost), with n ids of the table in one rank's batch over R rows, u = R(1 - e^(-n/R)) of them
distinct (uniform draws: an upper bound for skewed ids, which repeat more) and U = R(1 - e^(-Wn/R))
distinct over all W ranks:

  row-wise     sends (W-1)/W u keys, as many rows back as owner, as many gradients; works on u rows;
               2 row exchanges (forward and backward)
  table-wise   the table's rank sends (W-1) u rows; the others send u keys and u gradients; the
               table's rank works on U rows; 2 row exchanges
  replicated   every rank sends (W-1) u keys and (W-1) u gradients and works on U rows; 1 row exchange
  column-wise  over k ranks: each of them sends (W-1) u rows of dim/k; every rank sends u keys and u
               gradients of dim/k to each of the k it is not; each of the k works on U rows of dim/k;
               2 row exchanges

seconds = bytes / bytes_per_second + exchanges x seconds_per_exchange + rows worked x (dim x
seconds_per_float + seconds_per_key) (CostModel: estimates for a 2-core VM of this project's CI, see
docs/guide/sharding.md). A replicated table also holds every row on every rank: the memory budget
(memory_budget=, by default in init(sharding_plan="auto") half the host's memory shared by its
ranks) keeps large tables from being replicated.
"""
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..formats.sharding_plan import (COLUMN_WISE, REPLICATED, ROW_WISE, TABLE_WISE, Placement, PlanError,
                                     ShardingPlan, TableCost, TablePlan, check_group)

KEY_BYTES = 8


@dataclass(frozen=True)
class TableShape:
    """What the planner knows of a table: `rows` (its vocabulary), `dim`, `row_bytes` (a row's memory
    with optimizer slots and metadata; default: float32 values and two slots), the ids of its
    features in one rank's batch (`ids_per_step`, 0: unknown, taken as `rows`), and optionally the
    distinct ids measured per batch and constraints: `sharding` (and `rank` for a table-wise one), and
    `group`, a name shared by tables placed together (one placement for all: for a table-wise group,
    one rank, so that the features that read them are looked up on one rank); `ssd`: the table has an
    SSD tier, which a replicated table cannot have; `wire_bytes`: a value's bytes in the row exchange
    (2 with create_table(exchange_dtype=) 16-bit)."""
    name: str
    rows: int
    dim: int
    row_bytes: int = 0
    ids_per_step: int = 0
    distinct_per_step: Optional[int] = None
    sharding: Optional[str] = None
    rank: object = None  # a table-wise table's rank, a column-wise table's list of ranks
    group: Optional[str] = None
    ssd: bool = False
    wire_bytes: int = 4

    @property
    def bytes_per_row(self) -> int:
        return self.row_bytes or 3 * 4 * self.dim + 16


@dataclass(frozen=True)
class CostModel:
    """The machine as the planner sees it (its defaults: bench/README.md, "Sharding placements")."""
    bytes_per_second: float = 1.0e9
    seconds_per_exchange: float = 10e-6
    seconds_per_float: float = 1.0e-9
    seconds_per_key: float = 50e-9  # a distinct key's index work on the rank that holds it


def _distinct(rows: int, draws: float) -> int:
    """Expected distinct values among `draws` uniform draws from `rows`."""
    if rows <= 0 or draws <= 0:
        return 0
    return max(1, min(rows, int(round(rows * -math.expm1(-draws / rows)))))


def table_cost(shape: TableShape, placement: Placement, world_size: int, model: CostModel = CostModel()) -> TableCost:
    """What `shape` costs each rank per step under `placement` (the module's docstring)."""
    w = world_size
    n = shape.ids_per_step or shape.rows
    u = shape.distinct_per_step if shape.distinct_per_step is not None else _distinct(shape.rows, n)
    u_all = _distinct(shape.rows, w * n) if shape.distinct_per_step is None else min(shape.rows, w * u)
    row = shape.wire_bytes * shape.dim
    # A column-wise slice holds its share of each row's values and slots.
    row_memory = math.ceil(shape.bytes_per_row / placement.native_slices)
    memory = [placement.rows_on(r, w, shape.rows) * row_memory for r in range(w)]
    if w == 1:
        sent, work, exchanges = [0], [u], 0
    elif placement.kind == ROW_WISE:
        share = (w - 1) / w * u
        sent, work, exchanges = [int(share * (KEY_BYTES + 2 * row))] * w, [u] * w, 2
    elif placement.kind in (TABLE_WISE, COLUMN_WISE):
        holders, k = placement.ranks(w), placement.native_slices
        part = row // k
        sent = [(w - 1) * u * part * (r in holders) + (k - (r in holders)) * u * (KEY_BYTES + part) for r in range(w)]
        work, exchanges = [u_all * (r in holders) for r in range(w)], 2
    else:
        sent, work, exchanges = [(w - 1) * u * (KEY_BYTES + row)] * w, [u_all] * w, 1
    width = placement.row_dim(shape.dim)
    seconds = [sent[r] / model.bytes_per_second + exchanges * model.seconds_per_exchange
               + work[r] * (width * model.seconds_per_float + model.seconds_per_key) for r in range(w)]
    return TableCost(shape.rows, shape.dim, shape.bytes_per_row, n, u, tuple(memory), tuple(int(s) for s in sent),
                     tuple(seconds), exchanges)


def _candidates(shape: TableShape, world_size: int) -> List[Placement]:
    columns = [] if shape.ssd else [Placement(COLUMN_WISE, first, k) for k in range(2, world_size + 1)
                                    if shape.dim % k == 0 for first in range(world_size - k + 1)]
    if shape.sharding is not None:
        given = Placement.checked(shape.name, shape.sharding, shape.rank, world_size)
        if given.kind == TABLE_WISE and given.rank is None:
            return [Placement(TABLE_WISE, r) for r in range(world_size)]
        if given.kind == COLUMN_WISE and given.rank is None:
            return columns or [Placement(COLUMN_WISE, 0, 1)]  # one rank, or no split of the dim: one slice
        given.check_dim(shape.name, shape.dim)
        return [given]
    # On one rank every placement costs the same: row-wise wins the tie, the others stay allowed
    # for a group whose other tables ask for them.
    replicated = [] if shape.ssd else [Placement(REPLICATED)]
    return [Placement(ROW_WISE)] + replicated + [Placement(TABLE_WISE, r) for r in range(world_size)] + columns


class Loads:
    """Each rank's estimated seconds and memory so far, as the planner fills them table by table."""

    def __init__(self, world_size: int, budget: Union[None, int, Sequence[int]]):
        self.world_size = world_size
        self.seconds = np.zeros(world_size)
        self.memory = np.zeros(world_size, dtype=np.int64)
        if budget is None:
            self.budget = None
        else:
            given = [budget] * world_size if isinstance(budget, (int, np.integer)) else list(budget)
            if len(given) != world_size or any(b <= 0 for b in given):
                raise PlanError(f"memory budget {budget!r}: give one positive number of bytes, or one per rank "
                                f"({world_size} ranks)")
            self.budget = np.asarray(given, dtype=np.int64)

    def place(self, shape: TableShape, model: CostModel, chosen_by: str = "planner") -> TablePlan:
        """The candidate placement of `shape` that leaves the most loaded rank least loaded (ties: the
        least total cost, then the first candidate), within every rank's memory budget."""
        return self.place_together([shape], model, chosen_by)[shape.name]

    def place_together(self, shapes: Sequence[TableShape], model: CostModel,
                       chosen_by: str = "planner") -> Dict[str, TablePlan]:
        """One placement for all of `shapes` (a group: their costs added up), chosen as place() chooses
        one table's, among the placements every one of them allows."""
        best: Optional[Tuple[Tuple[float, float, int], Placement, List[TableCost]]] = None
        tried = []
        for i, placement in enumerate(self._windows_least_loaded(_common_candidates(shapes, self.world_size))):
            costs = [table_cost(shape, placement, self.world_size, model) for shape in shapes]
            # Plain sums: numpy's per-call cost would be most of a plan of 1,000 tables.
            added = [sum(column) for column in zip(*(c.memory for c in costs))]
            tried.append((placement, added))
            if self.budget is not None and any(m + a > b for m, a, b in zip(self.memory.tolist(), added,
                                                                            self.budget.tolist())):
                continue
            spent = [sum(column) for column in zip(*(c.seconds for c in costs))]
            seconds = max(s + t for s, t in zip(self.seconds.tolist(), spent))
            key = (round(seconds, 12), round(sum(spent), 12), i)
            if best is None or key < best[0]:
                best = (key, placement, costs)
        if best is None:
            raise PlanError(self._fits_nowhere(shapes, tried))
        _, placement, costs = best
        for cost in costs:
            self.seconds += np.asarray(cost.seconds)
            self.memory += np.asarray(cost.memory, dtype=np.int64)
        return {shape.name: TablePlan(placement, cost, chosen_by if shape.sharding is None else "user", shape.group)
                for shape, cost in zip(shapes, costs)}

    def _windows_least_loaded(self, candidates: List[Placement]) -> List[Placement]:
        """Of the column-wise candidates of each number of slices, the one on the ranks least loaded
        now (most loaded rank's seconds, then memory): a split costs the same wherever it lies, and a
        plan of 1,000 tables on 8 ranks stays well under a second."""
        best: Dict[int, Tuple[Tuple[float, int], Placement]] = {}
        for p in candidates:
            if p.kind == COLUMN_WISE and p.rank is not None:
                window = slice(p.rank, p.rank + p.slices)
                key = (float(self.seconds[window].max()), int(self.memory[window].max()))
                if p.slices not in best or key < best[p.slices][0]:
                    best[p.slices] = (key, p)
        chosen = {p for _, p in best.values()}
        return [p for p in candidates if p.kind != COLUMN_WISE or p.rank is None or p in chosen]

    def _fits_nowhere(self, shapes: Sequence[TableShape], tried) -> str:
        assert self.budget is not None
        needs = "; ".join(f"{p.describe()}: {int(max(m))} bytes on its fullest rank" for p, m in tried)
        free = [int(b - m) for b, m in zip(self.budget, self.memory)]
        what = (f"table {shapes[0].name!r} ({shapes[0].rows} rows of {shapes[0].bytes_per_row} bytes)"
                if len(shapes) == 1 else
                f"group {shapes[0].group!r} (tables {[s.name for s in shapes]}, placed together, "
                f"{sum(s.rows * s.bytes_per_row for s in shapes)} bytes of rows)")
        return (f"{what} fits in no rank's memory budget under any placement allowed ({needs}); the budgets are "
                f"{[int(b) for b in self.budget]} bytes per rank, of which {free} are still free after the tables "
                "placed before it. Raise the budget, add ranks, or shrink the table")


def _common_candidates(shapes: Sequence[TableShape], world_size: int) -> List[Placement]:
    """The placements every one of `shapes` allows, in the first one's order; none is a PlanError
    naming the group and each table's constraint."""
    allowed = [_candidates(shape, world_size) for shape in shapes]
    common = [p for p in allowed[0] if all(p in other for other in allowed[1:])]
    if not common:
        given = ", ".join(f"{s.name!r}: {s.sharding!r}" + (f" on rank {s.rank}" if s.rank is not None else "")
                          for s in shapes if s.sharding is not None)
        raise PlanError(f"group {shapes[0].group!r}: its tables {[s.name for s in shapes]} are placed together, but "
                        f"their sharding= constraints allow no placement in common ({given}); give them one "
                        "placement, or take a table out of the group")
    return common


def plan_sharding(tables: Sequence[TableShape], world_size: int, memory_budget: Union[None, int, Sequence[int]] = None,
                  model: CostModel = CostModel()) -> ShardingPlan:
    """A plan for `tables` on `world_size` ranks: tables in order of their row-wise cost, largest
    first (then by name), each placed where the most loaded rank stays least loaded; the tables of a
    group (TableShape.group) as one, by their summed cost. Deterministic: every rank that plans the
    same tables gets the same plan."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"plan_sharding: world_size {world_size!r} is not a number of ranks; allowed: an int >= 1")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise PlanError(f"plan_sharding: table names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    for t in tables:
        _check_shape(t)

    units: Dict[str, List[TableShape]] = {}
    for t in tables:  # a group is placed as one unit; a table of no group alone
        units.setdefault(f"group {t.group}" if t.group is not None else f"table {t.name}", []).append(t)

    def weight(unit: List[TableShape]) -> Tuple[float, str]:
        return (-sum(sum(table_cost(t, Placement(ROW_WISE), world_size, model).seconds) for t in unit),
                min(t.name for t in unit))

    loads = Loads(world_size, memory_budget)
    placed: Dict[str, TablePlan] = {}
    for unit in sorted(units.values(), key=weight):
        placed.update(loads.place_together(sorted(unit, key=lambda t: t.name), model))
    return ShardingPlan(world_size, placed)


def _check_shape(t: TableShape) -> None:
    for field_name in ("rows", "dim"):
        value = getattr(t, field_name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"table {t.name!r}: {field_name} {value!r}; allowed: an int >= 1")
    if isinstance(t.ids_per_step, bool) or not isinstance(t.ids_per_step, int) or t.ids_per_step < 0:
        raise PlanError(f"table {t.name!r}: ids_per_step {t.ids_per_step!r}; allowed: an int >= 0 (0: unknown)")
    check_group(t.name, t.group)

