"""Train or eval, said one way: the key pipeline's two channels, and the names of a lookup's row
exchanges.

The enum is the native core's (native/src/exchange/channel.h, `shardrec.native.core.Channel`): this module
repeats its two values so that it can be imported without loading the core, which starts MPI. The
core accepts these members wherever it takes a channel, and World checks at start that both agree.
"""
import enum
from dataclasses import dataclass
import json
from typing import Any, Dict, Iterable, List, Tuple


class Channel(enum.IntEnum):
    TRAIN = 0
    EVAL = 1

    @classmethod
    def of(cls, is_training: bool) -> "Channel":
        return cls.TRAIN if is_training else cls.EVAL

    @property
    def label(self) -> str:
        """'train' or 'eval', as logs, errors and heartbeats say it."""
        return self.name.lower()


def check_matches_native(native_channel: Any) -> None:
    """The native enum has the members and values of this one (a rebuilt core that changed them
    would otherwise pair the wrong channels silently)."""
    native = {name: int(value) for name, value in native_channel.__members__.items()}
    mine = {member.name: int(member) for member in Channel}
    if native != mine:
        raise RuntimeError(f"shardrec's native core has channels {native}, rank_runtime/formats/channel.py {mine}: rebuild "
                           "the native core (`bash scripts/bootstrap.sh`)")


@dataclass(frozen=True, order=True)
class RowExchangeName:
    """The row exchange of one lookup: the n-th lookup of `feature` on `table` and `channel` in a
    graph. Its rows go out on the communicator named `rows` and, for training, its gradients come
    back on the one named `gradients`; ranks pair the communicators by these names (world.py), and
    the op library finds them by the same strings."""
    table: str
    feature: str
    channel: Channel
    n: int
    tables: int = 0  # a table group's exchange (pipeline/table_groups.py): its tables (0: one lookup's)

    @property
    def rows(self) -> str:
        table = self.table if self.tables <= 1 else f"{self.table} and {self.tables - 1} more"
        return f"{table}/{self.feature}/{self.channel.label}#{self.n}"

    @property
    def gradients(self) -> str:
        return f"{self.rows} gradients"


@dataclass(frozen=True)
class ExchangeNames:
    """What one rank's lookups need of communicators (process/world.py make_row_exchanges), as the
    ranks compare them: a lookup's communicators pair by name, which every rank must build alike; a
    table group's by its place among its channel's groups ("group <i> of <channel>"), since ranks
    whose tables differ group them differently and must meet in the first key round, whose feature
    signature names the difference, not at the pipeline's start naming a group."""
    lookups: Dict[str, str]  # communicator name -> "<feature>@<channel>" of its lookup
    groups: Dict[str, str]   # group place -> this rank's communicator name
    grouped: List[str]       # "<feature>@<channel>" of the features looked up in a group

    @classmethod
    def of(cls, exchanges: Iterable[RowExchangeName], grouped: Iterable[Tuple[str, Channel]]) -> "ExchangeNames":
        exchanges = set(exchanges)
        lookups = {name: f"{e.feature}@{e.channel.label}" for e in exchanges if not e.tables
                   for name in (e.rows, e.gradients)}
        groups: Dict[str, str] = {}
        places: Dict[Channel, int] = {}
        for e in sorted((e for e in exchanges if e.tables), key=lambda e: (e.channel, e.rows)):
            place = places[e.channel] = places.get(e.channel, -1) + 1
            groups[f"group {place} of {e.channel.label}"] = e.rows
            groups[f"group {place} of {e.channel.label} gradients"] = e.gradients
        return cls(lookups, groups, sorted(f"{f}@{c.label}" for f, c in grouped))

    def to_json(self) -> str:
        return json.dumps({"lookups": self.lookups, "groups": self.groups, "grouped": self.grouped})

    @classmethod
    def from_json(cls, text: str) -> "ExchangeNames":
        raw = json.loads(text)
        return cls(raw["lookups"], raw["groups"], raw["grouped"])

    def name_of(self, key: str) -> "str | None":
        """This rank's communicator name for the agreed key (None: a place only another rank has)."""
        return key if key in self.lookups else self.groups.get(key)


def agreed_keys(every: List[ExchangeNames]) -> List[str]:
    """The communicators every rank creates, in one order: the lookups', which must be the same on
    every rank except those of features some rank looks up in a group (the key round names that
    difference), then every group place any rank has. ValueError naming the first difference."""
    grouped = set().union(*(e.grouped for e in every))
    strict = [{name for name, feature in e.lookups.items() if feature not in grouped} for e in every]
    for other in strict[1:]:
        if other != strict[0]:
            raise ValueError(f"the ranks built different lookups (first difference: {sorted(other ^ strict[0])[0]!r}); "
                             "every rank must build the same sparse_lookup calls")
    return sorted(set().union(*(e.lookups for e in every))) + sorted(set().union(*(e.groups for e in every)))
