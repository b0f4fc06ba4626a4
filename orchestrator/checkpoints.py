"""Reads shardrec checkpoints without TensorFlow: which ones exist, which are complete, and whether
their files still match their manifests.

The layout and the manifest are written by rank_runtime/sparse_checkpoint.py (see its docstring);
tests/test_ckpt_cli.py checks this reader against checkpoints that the Saver wrote.
"""
import json
import os
import re
import zlib
from dataclasses import dataclass, field

FORMAT = "shardrec-sparse-shard"
_SHARD_RE = re.compile(r"^rank-(\d+)-of-(\d+)$")
_SPARSE_RE = re.compile(r"^sparse-(.+)$")
_CHUNK = 64 * 2**20


@dataclass
class Shard:
    rank: int
    world_size: int
    path: str
    manifest: dict = None
    problems: list = field(default_factory=list)


@dataclass
class Checkpoint:
    name: str        # the dense checkpoint's file prefix, e.g. model.ckpt-100
    sparse_dir: str
    shards: dict     # rank -> Shard
    problems: list = field(default_factory=list)

    @property
    def world_size(self):
        sizes = {s.world_size for s in self.shards.values()}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def step(self):
        steps = {s.manifest.get("step") for s in self.shards.values() if s.manifest}
        return steps.pop() if len(steps) == 1 else None

    @property
    def ok(self):
        return not self.problems and all(not s.problems for s in self.shards.values())


def _crc_of(path):
    crc, size = 0, 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                return crc, size
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)


def _check_shard(shard, verify):
    path = os.path.join(shard.path, "MANIFEST.json")
    try:
        with open(path) as f:
            shard.manifest = json.load(f)
    except FileNotFoundError:
        shard.problems.append(f"{path}: missing (the save did not finish)")
        return
    except (ValueError, UnicodeDecodeError) as e:
        shard.problems.append(f"{path}: not a valid manifest ({e})")
        return
    if shard.manifest.get("format") != FORMAT:
        shard.problems.append(f"{path}: not a {FORMAT} manifest")
        return
    for table, entry in sorted(shard.manifest.get("tables", {}).items()):
        for name, item in sorted(entry.get("files", {}).items()):
            file = os.path.normpath(os.path.join(shard.path, item["file"]))
            if not file.startswith(os.path.normpath(shard.path) + os.sep):
                shard.problems.append(f"{path}: file {item['file']!r} lies outside the shard")
                continue
            if not os.path.exists(file):
                shard.problems.append(f"{file}: missing")
            elif os.path.getsize(file) != item["bytes"]:
                shard.problems.append(f"{file}: {os.path.getsize(file)} bytes, the manifest says {item['bytes']}")
            elif verify and _crc_of(file)[0] != item["crc32"]:
                shard.problems.append(f"{file}: checksum mismatch")


def read_checkpoint(sparse_dir, verify=True):
    """The checkpoint whose table shards lie in `sparse_dir` (<dir>/sparse-<name>)."""
    name = _SPARSE_RE.match(os.path.basename(os.path.normpath(sparse_dir))).group(1)
    ckpt = Checkpoint(name, sparse_dir, {})
    for entry in sorted(os.listdir(sparse_dir)):
        m = _SHARD_RE.match(entry)
        if m:
            shard = Shard(int(m.group(1)), int(m.group(2)), os.path.join(sparse_dir, entry))
            _check_shard(shard, verify)
            ckpt.shards[shard.rank] = shard
        elif entry.startswith(".tmp-"):
            ckpt.problems.append(f"{os.path.join(sparse_dir, entry)}: a shard that was never committed")
    size = ckpt.world_size
    if size is None:
        ckpt.problems.append("shards of different world sizes" if ckpt.shards else "no shard")
    else:
        layouts = {s.manifest.get("layout") for s in ckpt.shards.values() if s.manifest}
        expected = range(size) if layouts == {"shared"} else sorted(ckpt.shards)
        missing = [r for r in expected if r not in ckpt.shards]
        if missing:
            ckpt.problems.append(f"the shards of rank(s) {missing} of {size} are missing")
    return ckpt


def find_checkpoints(path, verify=True):
    """Checkpoints at `path`: a model directory (all of them, oldest first), a sparse-<name>
    directory, or a dense checkpoint prefix such as <dir>/model.ckpt-100."""
    path = os.path.abspath(path)
    if os.path.isdir(path) and _SPARSE_RE.match(os.path.basename(path)):
        return [read_checkpoint(path, verify)]
    head, tail = os.path.split(path)
    if os.path.isdir(os.path.join(head, f"sparse-{tail}")):
        return [read_checkpoint(os.path.join(head, f"sparse-{tail}"), verify)]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: neither a directory nor a checkpoint with a sparse-{tail} directory")
    found = [read_checkpoint(os.path.join(path, e), verify) for e in os.listdir(path)
             if _SPARSE_RE.match(e) and os.path.isdir(os.path.join(path, e))]
    return sorted(found, key=lambda c: (c.step is None, c.step or 0, c.name))
