"""Where a stream's partitions stood at a checkpoint's step, as types (no TensorFlow, no MPI).

A partition is a log of files read in the order of their names. Its position is the file the
training had reached and how many of its records were trained: every file named before `file` is
done. A shard's manifest holds the positions of the partitions its rank read, and which of them
held the batch cut by the save (`resume`), so that a restore into the same ranks goes on exactly
where the job stood; a restore into other ranks hands every partition to its new owner.
"""
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from .array_files import CheckpointError


@dataclass(frozen=True)
class PartitionPosition:
    file: Optional[str]  # None: nothing of the partition read yet
    offset: int  # records of `file` trained

    def to_json(self) -> dict:
        return {"file": self.file, "offset": self.offset}

    @classmethod
    def from_json(cls, raw, where: str) -> "PartitionPosition":
        if not isinstance(raw, dict) or not isinstance(raw.get("file"), (str, type(None))) or \
                not isinstance(raw.get("offset"), int) or isinstance(raw.get("offset"), bool) or raw["offset"] < 0:
            raise CheckpointError(f"{where}: a stream position is {{'file': name or null, 'offset': records >= 0}}, "
                                  f"got {raw!r}")
        return cls(raw["file"], raw["offset"])


@dataclass(frozen=True)
class StreamPositions:
    """A rank's partitions (by name) and their positions; resume: the partition whose file the
    save cut (None: none yet)."""
    partitions: Dict[str, PartitionPosition]
    resume: Optional[str] = None

    def to_json(self) -> dict:
        return {"partitions": {p: pos.to_json() for p, pos in sorted(self.partitions.items())}, "resume": self.resume}

    @classmethod
    def from_json(cls, raw, where: str) -> "StreamPositions":
        if not isinstance(raw, dict) or not isinstance(raw.get("partitions"), dict) or \
                not isinstance(raw.get("resume"), (str, type(None))):
            raise CheckpointError(f"{where}: 'stream' is {{'partitions': {{name: position}}, 'resume': name or null}}, "
                                  f"got {raw!r}")
        return cls({p: PartitionPosition.from_json(v, f"{where}: partition {p!r}") for p, v in raw["partitions"].items()},
                   raw["resume"])


def merged(shards: Dict[int, "StreamPositions"], source: str) -> Tuple[Dict[str, PartitionPosition], Dict[int, str]]:
    """Every partition's position over the shards of one save (each partition is read by one rank),
    and each saving rank's resume partition."""
    positions, owner = {}, {}
    for rank, stream in sorted(shards.items()):
        for name, pos in stream.partitions.items():
            if name in owner:
                raise CheckpointError(f"{source}: stream partition {name!r} is in the shards of rank {owner[name]} and "
                                      f"rank {rank}; a partition is read by one rank")
            positions[name], owner[name] = pos, rank
    return positions, {r: s.resume for r, s in shards.items() if s.resume is not None}
