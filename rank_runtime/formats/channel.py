"""Train or eval, said one way: the key pipeline's two channels, and the names of a lookup's row
exchanges.

The enum is the native core's (native/src/exchange/channel.h, `shardrec.native.core.Channel`): this module
repeats its two values so that it can be imported without loading the core, which starts MPI. The
core accepts these members wherever it takes a channel, and World checks at start that both agree.
"""
import enum
from dataclasses import dataclass
from typing import Any


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

    @property
    def rows(self) -> str:
        return f"{self.table}/{self.feature}/{self.channel.label}#{self.n}"

    @property
    def gradients(self) -> str:
        return f"{self.rows} gradients"
