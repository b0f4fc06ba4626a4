"""Where each table lives (a Placement) and a job's whole plan (ShardingPlan): what the planner
(embedding/planner.py) proposes, what a plan file holds, what rank 0 prints at start-up and what a
checkpoint keeps beside each table. No TensorFlow, no MPI: shardrec-ckpt reads it too.

A placement never changes what a checkpoint holds: every placement saves each key once, as the
row-wise placement does, with its whole row (a column-wise table's slices are joined on the way to
the checkpoint), so any checkpoint restores under any plan and any number of ranks.
"""
import json
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, TypeGuard, Union

import numpy as np

ROW_WISE, TABLE_WISE, REPLICATED, COLUMN_WISE = "row_wise", "table_wise", "replicated", "column_wise"
PLACEMENTS = (ROW_WISE, TABLE_WISE, REPLICATED, COLUMN_WISE)
AUTO = "auto"  # init(sharding_plan="auto"): the planner places every table create_table does not
# How the native key round names a placement (native/src/exchange/key_router.h).
_NATIVE_ROW_WISE, _NATIVE_REPLICATED = -1, -2


class PlanError(ValueError):
    """A placement, constraint or plan that cannot be used; the message names the table."""


@dataclass(frozen=True)
class Placement:
    """A table's placement: ROW_WISE (keys spread by key mod world size), TABLE_WISE (every key on
    `rank`), REPLICATED (every key on every rank, gradients combined every step) or COLUMN_WISE (the
    row split by dimension into `slices` equal slices, slice j on rank `rank` + j; each of those
    ranks holds every key, with its columns)."""
    kind: str
    rank: Optional[int] = None
    slices: int = 1

    @classmethod
    def checked(cls, table: str, kind: object, rank: object, world_size: int) -> "Placement":
        """A placement from a user's words, or a PlanError naming the table and what is allowed.
        `rank`: a table-wise table's rank, or a column-wise table's ranks (consecutive, one slice
        each); None: the planner's choice."""
        if kind not in PLACEMENTS:
            raise PlanError(f"table {table!r}: unknown sharding {kind!r}; allowed: "
                            f"{', '.join(repr(p) for p in PLACEMENTS)} (or None: the plan's or the planner's choice)")
        if kind == COLUMN_WISE:
            return cls._column_wise(table, rank, world_size)
        if kind != TABLE_WISE:
            if rank is not None:
                raise PlanError(f"table {table!r}: a rank ({rank!r}) is given for sharding={kind!r}; only a "
                                f"{TABLE_WISE!r} table lives on one rank (and a {COLUMN_WISE!r} one on a list of "
                                "ranks)")
            return cls(str(kind))
        if rank is None:
            return cls(TABLE_WISE)  # the planner picks the rank
        if not _is_rank(rank, world_size):
            raise PlanError(f"table {table!r}: table-wise rank {rank!r} is outside the world of {world_size} ranks; "
                            f"allowed: an int in [0, {world_size - 1}]")
        return cls(TABLE_WISE, int(rank))

    @classmethod
    def _column_wise(cls, table: str, ranks: object, world_size: int) -> "Placement":
        if ranks is None:
            return cls(COLUMN_WISE)  # the planner picks the ranks
        listed = list(ranks) if isinstance(ranks, (list, tuple)) else None
        if (not listed or not all(_is_rank(r, world_size) for r in listed)
                or [int(r) for r in listed] != list(range(int(listed[0]), int(listed[0]) + len(listed)))):
            raise PlanError(f"table {table!r}: column-wise ranks {ranks!r}; allowed: a list of consecutive ranks in "
                            f"[0, {world_size - 1}], one slice of the row's columns on each (such as [0, 1]), or "
                            "None: the planner's choice")
        return cls(COLUMN_WISE, int(listed[0]), len(listed))

    def check_dim(self, table: str, dim: int) -> None:
        """A column-wise table's slices are equal: its dim must divide by their number."""
        if self.kind == COLUMN_WISE and dim % self.slices:
            raise PlanError(f"table {table!r}: dim {dim} does not split into {self.slices} equal column slices (ranks "
                            f"{self.ranks(0)}); allowed: a number of ranks that divides the dim "
                            f"({[k for k in range(1, dim + 1) if dim % k == 0]})")

    @property
    def native(self) -> int:
        """The key round's number for it: -1 row-wise, -2 replicated, the (first) rank of a table-wise
        or column-wise table (native_slices: how many ranks from it on)."""
        if self.kind in (TABLE_WISE, COLUMN_WISE):
            assert self.rank is not None, "a table-wise placement is given its rank before it is used"
            return self.rank
        return _NATIVE_REPLICATED if self.kind == REPLICATED else _NATIVE_ROW_WISE

    @property
    def native_slices(self) -> int:
        return self.slices if self.kind == COLUMN_WISE else 1

    def ranks(self, world_size: int) -> List[int]:
        """The ranks that hold rows of the table."""
        if self.kind in (TABLE_WISE, COLUMN_WISE) and self.rank is not None:
            return list(range(self.rank, self.rank + self.native_slices))
        return list(range(world_size))

    def rows_on(self, rank: int, world_size: int, rows: int) -> int:
        """Rows of a table of `rows` rows that `rank` reserves (at least one: a rank that holds none
        still has a store its lookups read the empty row of)."""
        if self.kind == REPLICATED:
            return rows
        if self.kind in (TABLE_WISE, COLUMN_WISE):
            return rows if self.rank is not None and 0 <= rank - self.rank < self.native_slices else 1
        return math.ceil(rows / world_size)

    def row_dim(self, dim: int) -> int:
        """The columns of each row that a rank's store holds (every rank's store is as wide)."""
        return dim // self.native_slices

    def columns_on(self, rank: int, dim: int) -> slice:
        """The columns of the whole row that `rank` holds (a restore takes these; a column-wise
        table's rank that holds no slice has a store as wide as one, which no key reaches)."""
        if self.kind != COLUMN_WISE or self.rank is None:
            return slice(0, dim)
        width, j = self.row_dim(dim), rank - self.rank
        return slice(j * width, (j + 1) * width) if 0 <= j < self.slices else slice(0, width)

    def holds(self, keys: np.ndarray, rank: int, world_size: int) -> np.ndarray:
        """Which of `keys` `rank` holds (a restore takes these)."""
        if self.kind == REPLICATED:
            return np.ones(keys.shape, bool)
        if self.kind in (TABLE_WISE, COLUMN_WISE):
            return np.full(keys.shape, rank in self.ranks(world_size))
        return np.mod(keys.astype(np.int64), world_size) == rank

    def describe(self) -> str:
        if self.kind == COLUMN_WISE and self.rank is not None:
            return f"{COLUMN_WISE} on ranks {_ranks_text(self.ranks(0))}"
        return f"{TABLE_WISE} on rank {self.rank}" if self.kind == TABLE_WISE else self.kind

    def to_json(self) -> dict:
        if self.kind == COLUMN_WISE:
            return {"sharding": self.kind, "ranks": self.ranks(0)}
        return {"sharding": self.kind, **({"rank": self.rank} if self.kind == TABLE_WISE else {})}

    @classmethod
    def from_json(cls, table: str, raw: object, world_size: int, source: str) -> "Placement":
        if not isinstance(raw, dict) or "sharding" not in raw:
            raise PlanError(f"{source}: table {table!r} has no 'sharding' (an object such as "
                            f"{{\"sharding\": \"row_wise\"}}, {{\"sharding\": \"table_wise\", \"rank\": 0}} or "
                            f"{{\"sharding\": \"column_wise\", \"ranks\": [0, 1]}})")
        field_name = "ranks" if raw["sharding"] == COLUMN_WISE else "rank"
        if raw["sharding"] in (TABLE_WISE, COLUMN_WISE) and raw.get(field_name) is None:
            raise PlanError(f"{source}: table {table!r} is {raw['sharding']} with no {field_name!r}; a plan names "
                            f"where it lives (such as {{\"sharding\": \"table_wise\", \"rank\": 0}} or "
                            f"{{\"sharding\": \"column_wise\", \"ranks\": [0, 1]}})")
        return cls.checked(table, raw["sharding"], raw.get(field_name), world_size)


def _is_rank(rank: object, world_size: int) -> TypeGuard[Union[int, np.integer]]:
    return not isinstance(rank, bool) and isinstance(rank, (int, np.integer)) and 0 <= int(rank) < world_size


@dataclass(frozen=True)
class TableCost:
    """What the planner expects of one table under its placement, per training step: its ids and
    distinct ids per rank, the bytes each rank sends (keys, rows, gradients), the memory each rank
    holds and the row exchanges the table costs."""
    rows: int
    dim: int
    row_bytes: int
    ids_per_step: int
    distinct_per_step: int
    memory: Tuple[int, ...]       # per rank, bytes
    bytes_sent: Tuple[int, ...]   # per rank and step
    seconds: Tuple[float, ...]    # per rank and step, the cost model's estimate
    exchanges: int

    def to_json(self) -> dict:
        return {"rows": self.rows, "dim": self.dim, "row_bytes": self.row_bytes, "ids_per_step": self.ids_per_step,
                "distinct_per_step": self.distinct_per_step, "memory": list(self.memory),
                "bytes_sent": list(self.bytes_sent), "seconds": list(self.seconds), "exchanges": self.exchanges}

    @classmethod
    def from_json(cls, raw: dict) -> "TableCost":
        return cls(int(raw["rows"]), int(raw["dim"]), int(raw["row_bytes"]), int(raw["ids_per_step"]),
                   int(raw["distinct_per_step"]), tuple(int(x) for x in raw["memory"]),
                   tuple(int(x) for x in raw["bytes_sent"]), tuple(float(x) for x in raw["seconds"]),
                   int(raw["exchanges"]))


def check_group(table: str, group: object) -> None:
    """A group name (tables placed together) is a non-empty string."""
    if group is not None and (not isinstance(group, str) or not group):
        raise PlanError(f"table {table!r}: sharding group {group!r}; allowed: a non-empty string naming the tables "
                        "placed together, or None")


@dataclass(frozen=True)
class TablePlan:
    placement: Placement
    cost: Optional[TableCost] = None  # None: placed by the user with nothing known of its traffic
    chosen_by: str = "planner"        # "planner", "user" (sharding=), "plan file", "group"
    group: Optional[str] = None       # the tables of one group share one placement

    def to_json(self) -> dict:
        out = dict(self.placement.to_json(), chosen_by=self.chosen_by)
        if self.group is not None:
            out["group"] = self.group
        if self.cost is not None:
            out["cost"] = self.cost.to_json()
        return out

    @classmethod
    def from_json(cls, table: str, raw: object, world_size: int, source: str, with_cost: bool = True) -> "TablePlan":
        placement = Placement.from_json(table, raw, world_size, source)
        assert isinstance(raw, dict)  # from_json has checked it
        cost = raw.get("cost")
        try:
            parsed = TableCost.from_json(cost) if cost and with_cost else None
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{source}: table {table!r}: its cost estimate is damaged ({e!r})") from None
        chosen_by = raw.get("chosen_by", "plan file")
        group = raw.get("group")
        try:
            check_group(table, group)
        except PlanError as e:
            raise PlanError(f"{source}: {e}") from None
        return cls(placement, parsed, chosen_by if isinstance(chosen_by, str) else "plan file", group)


@dataclass(frozen=True)
class ShardingPlan:
    """Every table's placement for a world of `world_size` ranks, with the planner's estimates."""
    world_size: int
    tables: Dict[str, TablePlan] = field(default_factory=dict)

    def placement(self, table: str) -> Optional[Placement]:
        entry = self.tables.get(table)
        return entry.placement if entry is not None else None

    def per_rank(self) -> Tuple[List[int], List[int], List[float]]:
        """(memory, bytes sent per step, estimated seconds per step) of each rank, over the tables
        with estimates."""
        w = self.world_size
        memory, sent, seconds = [0] * w, [0] * w, [0.0] * w
        for entry in self.tables.values():
            if entry.cost is None:
                continue
            for r in range(w):
                memory[r] += entry.cost.memory[r]
                sent[r] += entry.cost.bytes_sent[r]
                seconds[r] += entry.cost.seconds[r]
        return memory, sent, seconds

    def to_json(self) -> dict:
        return {"format": "shardrec-sharding-plan", "version": 1, "world_size": self.world_size,
                "tables": {name: entry.to_json() for name, entry in sorted(self.tables.items())}}

    @classmethod
    def from_json(cls, raw: object, source: str, world_size: Optional[int] = None) -> "ShardingPlan":
        """A plan as written by to_json (or by hand: only each table's "sharding", and "rank" for a
        table-wise one, are required), for a world of `world_size` ranks (default: the plan's)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("tables"), dict):
            raise PlanError(f"{source}: not a sharding plan (a JSON object with \"tables\": {{name: "
                            "{\"sharding\": ...}}})")
        size = world_size if world_size is not None else raw.get("world_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise PlanError(f"{source}: the plan's world_size {size!r} is not a number of ranks")
        same_world = raw.get("world_size") == size
        plan = cls(size, {name: TablePlan.from_json(name, entry, size, source, same_world)
                          for name, entry in raw["tables"].items()})
        plan.check_groups(source)
        return plan

    def check_groups(self, source: str) -> None:
        """The tables of each group share one placement, or a PlanError names them and theirs."""
        groups: Dict[str, Dict[str, Placement]] = {}
        for name, entry in sorted(self.tables.items()):
            if entry.group is not None:
                groups.setdefault(entry.group, {})[name] = entry.placement
        for group, members in sorted(groups.items()):
            if len(set(members.values())) > 1:
                raise PlanError(f"{source}: group {group!r} places its tables apart ("
                                + ", ".join(f"{n!r}: {p.describe()}" for n, p in members.items())
                                + "); the tables of a group share one placement")

    @classmethod
    def load(cls, path: str, world_size: int) -> "ShardingPlan":
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise PlanError(f"sharding plan {path!r} does not exist; give the path of a JSON plan "
                            "(plan_sharding(...).to_json() writes one)") from None
        except (OSError, ValueError) as e:
            raise PlanError(f"sharding plan {path!r} cannot be read as JSON: {e}") from None
        return cls.from_json(raw, path, world_size)

    def check_tables(self, names: Sequence[str]) -> None:
        """The plan names exactly the tables `names`: one it names that does not exist, or a table it
        does not name, is a PlanError naming both lists."""
        unknown = sorted(set(self.tables) - set(names))
        missing = sorted(set(names) - set(self.tables))
        if unknown or missing:
            parts = ([f"names table(s) {unknown} that the job does not create"] if unknown else []) + \
                    ([f"does not place table(s) {missing}"] if missing else [])
            raise PlanError(f"the sharding plan {' and '.join(parts)}; the job's tables: {sorted(names)}. "
                            "Give every table once, by the name create_table gives it")

    def render(self) -> str:
        """The plan as a table: per table, then per rank, then the imbalance (docs/guide/sharding.md
        says how to read it)."""
        w = self.world_size
        lines = [f"sharding plan for {w} rank(s), {len(self.tables)} table(s)",
                 f"{'table':<24} {'placement':<26} {'ranks':<12} {'rows':>11} {'dim':>5} {'ids/step':>9} "
                 f"{'distinct':>9} {'MB/rank':>9} {'KB sent/step':>13} {'chosen by':<10} group"]
        for name, entry in sorted(self.tables.items()):
            p, c = entry.placement, entry.cost
            ranks, group = _ranks_text(p.ranks(w)), entry.group or "-"
            if c is None:
                lines.append(f"{name:<24} {p.describe():<26} {ranks:<12} {'?':>11} {'?':>5} {'?':>9} {'?':>9} "
                             f"{'?':>9} {'?':>13} {entry.chosen_by:<10} {group}")
                continue
            lines.append(f"{name:<24} {p.describe():<26} {ranks:<12} {c.rows:>11} {c.dim:>5} {c.ids_per_step:>9} "
                         f"{c.distinct_per_step:>9} {max(c.memory) / 2**20:>9.2f} {sum(c.bytes_sent) / 1024:>13.1f} "
                         f"{entry.chosen_by:<10} {group}")
        memory, sent, seconds = self.per_rank()
        lines.append(f"{'rank':<6} {'MB':>10} {'KB sent/step':>13} {'est. ms/step':>13}")
        for r in range(w):
            lines.append(f"{r:<6} {memory[r] / 2**20:>10.2f} {sent[r] / 1024:>13.1f} {seconds[r] * 1e3:>13.3f}")
        mean = sum(seconds) / w if w else 0.0
        imbalance = max(seconds) / mean if mean > 0 else 1.0
        critical = max(range(w), key=lambda r: seconds[r]) if w else 0
        lines.append(f"imbalance (most loaded rank's estimate / mean): {imbalance:.2f}; critical path: rank {critical}")
        return "\n".join(lines)


def _ranks_text(ranks: List[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)
