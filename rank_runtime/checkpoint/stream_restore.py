"""A checkpoint's stream positions handed to the stream a restored job trains from."""
from typing import Any
from ..formats.sparse_checkpoint import CheckpointError, find_shards, read_manifest, sparse_dir
from ..formats.stream_positions import merged
from ..process import config
from ..process.logs import get_logger

log = get_logger("shardrec.checkpoint")


def restore_stream(stream: Any, save_path: str) -> None:
    """Every partition's position over the save's shards (each was read by one rank of the job
    that saved), and the partition whose file this rank's own save cut when the ranks are the same."""
    root = sparse_dir(save_path)
    shards, saved_size = find_shards(root)
    manifests = {rank: read_manifest(folder) for rank, folder in shards.items()}
    without = sorted(rank for rank, m in manifests.items() if m.stream is None)
    if without:
        raise CheckpointError(f"{root}: the shard(s) of rank(s) {without} hold no stream positions (saved by a job that "
                              "did not train from a stream); a job that trains from a stream restores a checkpoint of "
                              "one, or starts its stream from the beginning without a restore")
    positions, resumes = merged({rank: m.stream for rank, m in manifests.items()}, root)
    cfg = config.get_config()
    step = next(iter(manifests.values())).step
    stream.restore(positions, resumes.get(cfg.rank) if saved_size == cfg.size else None, step or 0)
    log.info("stream %s resumes at step %s: %s", stream.source, step,
             ", ".join(f"partition {p} at {pos}" for p, pos in sorted(positions.items())
                       if p in stream.owned) or "no partition read yet")
