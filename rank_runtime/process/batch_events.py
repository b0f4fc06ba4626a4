"""What the key pipeline tells of its batches, and who listens.

The key pipeline (pipeline/key_pipeline.py) does one thing a batch, the exchange; what else a
batch means belongs to observers, each registered where it is made:

    heartbeat.start()             the batch count in the next beat
    metrics.start_from_environment()   samples trained and the tables' figures
    resize.observe_stops()        the stop a resize or SIGTERM asked for, said once
    PartitionedStream.dataset()   the stream's cursor: which records the batch held
    Saver (incremental saves)     rank 0's clock asks for a save in the next status round
    start_asc_pipeline()          the end of a pass, in the log

Observers run on the key pipeline's thread, in the order they were registered, once per batch:
cheap work, no collective, nothing that waits. init() starts with none registered, and
terminate_config_initializer() forgets them all.
"""
from dataclasses import dataclass, field
from typing import Any, List, Protocol, Sequence, Tuple

from ..formats.channel import Channel


@dataclass(frozen=True)
class BatchExchanged:
    """A batch's keys went through the exchange on every rank."""
    channel: Channel
    number: int                # in this pass of the channel, from 1
    examples: int
    tables: Tuple[Any, ...]    # the tables of the insert function that exchanged it
    exchange: Any              # the channel's native KeyExchange (a save request goes into its next round)


@dataclass(frozen=True)
class PassEnded:
    """A pass of a channel ended at the same batch on every rank."""
    channel: Channel
    batches: int               # exchanged in this pass
    for_stop: bool             # ended because the job was asked to stop (a resize, SIGTERM)
    this_rank_ran_out: bool    # this rank's own data ended (else another rank's did)
    ranks_out: Sequence[int]   # the ranks whose data ended


class BatchObserver(Protocol):
    def batch_exchanged(self, event: BatchExchanged) -> None: ...

    def pass_ended(self, event: PassEnded) -> None: ...


class Observer:
    """A BatchObserver that minds nothing until a subclass says: override the event you observe."""

    def batch_exchanged(self, event: BatchExchanged) -> None:
        pass

    def pass_ended(self, event: PassEnded) -> None:
        pass


@dataclass
class ObserversState:
    """The observers registered since init(), in order."""
    observers: List[BatchObserver] = field(default_factory=list)


_STATE = ObserversState()


def register(observer: BatchObserver) -> None:
    """Adds `observer` (once: one equal to a registered one is not added again)."""
    if observer not in _STATE.observers:
        _STATE.observers.append(observer)


def unregister(observer: BatchObserver) -> None:
    if observer in _STATE.observers:
        _STATE.observers.remove(observer)


def forget_all() -> None:
    _STATE.observers.clear()


def observers() -> List[BatchObserver]:
    """The registered observers, in order (a copy: one may unregister while the others are told)."""
    return list(_STATE.observers)


def batch_exchanged(event: BatchExchanged) -> None:
    for observer in observers():
        observer.batch_exchanged(event)


def pass_ended(event: PassEnded) -> None:
    for observer in observers():
        observer.pass_ended(event)
