"""The seam between a graph's lookups and its key pipeline: what each lookup asks of the exchanges,
as typed values that sparse_lookup and the table groups produce and the key pipeline, the world's
communicators and the step profile consume.

Two kinds: a feature's key round (`FeatureExchange`: its keys per destination with static shapes,
whether a lookup weighs its pooled ids) and a row exchange (`RowExchange`: the lookup's or the
table group's rows out and gradients back, in the dtype rows cross in, under the name ranks pair
its communicators by). Ranks build a graph's lookups in any order and must agree on both, so
names count what came before them: the n-th row exchange of a (table, feature, channel).
"""
import enum
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Generic, List, Optional, Set, Tuple, TypeVar

import tensorflow as tf

from ..formats.channel import Channel, RowExchangeName
from ..process import config

T = TypeVar("T")


class Pooling(enum.IntEnum):
    """How the key round pools a feature's ids: the native FeatureSet's code (pooling.h)."""
    NONE = 0      # one row per id
    WEIGHTED = 1  # pooled, and a lookup weighs the ids: singleton partials cannot be shared
    SHARED = 2    # pooled by lookups without weights only: singleton partials are shared


@dataclass(frozen=True)
class FeatureExchange:
    """What the lookups of one feature on one channel ask of its key round."""
    feature: str
    channel: Channel
    send_count: int = 0  # keys sent to each rank with static shapes (0: dynamic shapes)
    weighted: bool = False

    def pooling(self, pooled: bool) -> Pooling:
        """The key round's pooling of this feature, whose ids the dataset batched as `pooled`."""
        if not pooled:
            return Pooling.NONE
        return Pooling.WEIGHTED if self.weighted else Pooling.SHARED


@dataclass(frozen=True)
class RowExchange:
    """One lookup's (or one table group's) row exchange: rows out, gradients back."""
    name: RowExchangeName
    wire: str                   # the dtype rows and gradients cross in
    features: Tuple[str, ...]   # the features whose rows it carries, in the order it carries them


class PerGraph(Generic[T]):
    """A value of each TensorFlow graph for the running init(): a graph that outlives
    terminate_config_initializer() starts afresh under the next init(), as its tables do."""

    def __init__(self, make: Callable[[], T]):
        self._make = make
        self._values: "weakref.WeakKeyDictionary[tf.Graph, Tuple[object, T]]" = weakref.WeakKeyDictionary()

    def of(self, graph: Optional[tf.Graph] = None) -> T:
        graph = graph or tf.compat.v1.get_default_graph()
        cfg = config.get_config()
        entry = self._values.get(graph)
        if entry is None or entry[0] is not cfg:
            entry = self._values[graph] = (cfg, self._make())
        return entry[1]


@dataclass
class GraphExchanges:
    """A graph's exchanges, as its lookups asked for them."""
    features: Dict[Tuple[str, Channel], FeatureExchange] = field(default_factory=dict)
    rows: List[RowExchange] = field(default_factory=list)

    def ask(self, feature: str, channel: Channel, send_count: Optional[int] = None,
            weighted: bool = False) -> FeatureExchange:
        """Files a lookup's needs of `feature`'s key round: lookups of one feature agree on
        send_count; one that weighs ids makes the feature's pooling weighted."""
        known = self.feature(feature, channel)
        if send_count is not None:
            if known.send_count and known.send_count != send_count:
                raise ValueError(f"sparse_lookup: feature {feature!r} ({channel.label}) is already looked up with "
                                 f"send_count={known.send_count}; a second lookup of it asks for "
                                 f"send_count={send_count}; one feature has one send_count per channel")
            known = FeatureExchange(feature, channel, send_count, known.weighted)
        if weighted:
            known = FeatureExchange(feature, channel, known.send_count, True)
        self.features[(feature, channel)] = known
        return known

    def feature(self, feature: str, channel: Channel) -> FeatureExchange:
        """What lookups asked of `feature`'s key round (dynamic and unweighted if none asked)."""
        return self.features.get((feature, channel), FeatureExchange(feature, channel))

    def row_exchange(self, table: str, features: Tuple[str, ...], channel: Channel, wire: str,
                     tables: int = 0) -> RowExchange:
        """A new row exchange for the rows of `features` (one lookup's, or a group's of `tables`
        tables named after its first `table` and feature)."""
        n = sum(1 for e in self.rows if (e.name.table, e.name.feature, e.name.channel) == (table, features[0], channel))
        exchange = RowExchange(RowExchangeName(table, features[0], channel, n, tables), wire, features)
        self.rows.append(exchange)
        return exchange

    def names(self, channel: Optional[Channel] = None) -> Set[RowExchangeName]:
        """The row exchanges' names (of one channel's, or of both)."""
        return {e.name for e in self.rows if channel is None or e.name.channel == channel}


@dataclass
class _ExchangesState:
    by_graph: PerGraph[GraphExchanges] = field(default_factory=lambda: PerGraph(GraphExchanges))


_STATE = _ExchangesState()


def of_graph(graph: Optional[tf.Graph] = None) -> GraphExchanges:
    """The exchanges of `graph` (default: the default graph)."""
    return _STATE.by_graph.of(graph)
