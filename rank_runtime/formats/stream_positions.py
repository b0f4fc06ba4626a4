"""Where a stream's partitions stood at a checkpoint's step, as types (no TensorFlow, no MPI).

A partition of a directory is a log of files read in the order of their names: its position is
the file the training had reached and how many of its records were trained, every file named
before `file` done. A partition of a broker is a log of entries of one record or of several (a
packed entry): its position is the id of the last entry trained to its end (`file`), how many
entries were (`offset`), and how many records of the entry after it were (`within`).

A shard's manifest holds the positions of the partitions its rank read, and which of them held
the batch cut by the save (`resume`), so that a restore into the same ranks goes on exactly where
the job stood; a restore into other ranks hands every partition to its new owner.
"""
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .array_files import CheckpointError


@dataclass(frozen=True)
class PartitionPosition:
    file: Optional[str]  # None: nothing of the partition read yet
    offset: int  # records of `file` trained (a directory); entries trained (a broker)
    within: int = 0  # a broker: records of the entry after `file` trained (a save cut a packed entry)

    def to_json(self) -> dict:
        out = {"file": self.file, "offset": self.offset}
        if self.within:
            out["within"] = self.within
        return out

    @classmethod
    def from_json(cls, raw: Any, where: str) -> "PartitionPosition":
        def count(name):
            value = raw.get(name, 0)
            return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

        if not isinstance(raw, dict) or not isinstance(raw.get("file"), (str, type(None))) or "offset" not in raw or \
                count("offset") is None or count("within") is None:
            raise CheckpointError(f"{where}: a stream position is {{'file': name or null, 'offset': count >= 0, "
                                  f"optionally 'within': records >= 0}}, got {raw!r}")
        return cls(raw["file"], raw["offset"], raw.get("within", 0))


@dataclass(frozen=True)
class StreamPositions:
    """A rank's partitions (by name) and their positions; resume: the partition whose file the
    save cut (None: none yet)."""
    partitions: Dict[str, PartitionPosition]
    resume: Optional[str] = None

    def to_json(self) -> dict:
        return {"partitions": {p: pos.to_json() for p, pos in sorted(self.partitions.items())}, "resume": self.resume}

    @classmethod
    def from_json(cls, raw: Any, where: str) -> "StreamPositions":
        if not isinstance(raw, dict) or not isinstance(raw.get("partitions"), dict) or \
                not isinstance(raw.get("resume"), (str, type(None))):
            raise CheckpointError(f"{where}: 'stream' is {{'partitions': {{name: position}}, 'resume': name or null}}, "
                                  f"got {raw!r}")
        return cls({p: PartitionPosition.from_json(v, f"{where}: partition {p!r}") for p, v in raw["partitions"].items()},
                   raw["resume"])


def merged(shards: Dict[int, "StreamPositions"], source: str) -> Tuple[Dict[str, PartitionPosition], Dict[int, str]]:
    """Every partition's position over the shards of one save (each partition is read by one rank),
    and each saving rank's resume partition."""
    positions: Dict[str, PartitionPosition] = {}
    owner: Dict[str, int] = {}
    for rank, stream in sorted(shards.items()):
        for name, pos in stream.partitions.items():
            if name in owner:
                raise CheckpointError(f"{source}: stream partition {name!r} is in the shards of rank {owner[name]} and "
                                      f"rank {rank}; a partition is read by one rank")
            positions[name], owner[name] = pos, rank
    return positions, {r: s.resume for r, s in shards.items() if s.resume is not None}
