"""Which checkpoint is the latest: TensorFlow's state file, read through get_checkpoint_state,
which tf_patches.py installs in TensorFlow's place. A rank lists a checkpoint only after every
rank committed its shard, but a checkpoint written by a job that died mid-save (or whose shards
were deleted) may still be listed: it is skipped for the newest complete one.
"""
import os

from tensorflow.python.checkpoint import checkpoint_management

from . import config
from .logs import get_logger
from .sparse_checkpoint import CheckpointError, needed_shards, sparse_dir
from .state import STATE

log = get_logger("shardrec.saver")


def rank_state_filename(rank: int) -> str:
    """The state file (TensorFlow's `checkpoint`) of a rank that saves under a path of its own."""
    return f"checkpoint.rank-{rank}"


def restorable(path: str, cfg: config.RuntimeConfig) -> bool:
    """Whether `path`'s dense part and every table shard this rank needs are committed."""
    if not checkpoint_management.checkpoint_exists_internal(path):
        return False
    root = sparse_dir(path)
    if not os.path.isdir(root):
        return True  # a checkpoint of a graph without tables
    try:
        needed_shards(root, cfg.rank, cfg.size)
    except CheckpointError as e:
        log.warning("checkpoint %s is not complete, skipped: %s", path, e)
        return False
    return True


def get_checkpoint_state(checkpoint_dir: str, latest_filename: str | None = None):
    """TensorFlow's, except that model_checkpoint_path names the newest checkpoint whose table
    shards were all committed: rank 0 records a checkpoint before the other ranks may have
    finished theirs (or after one of them died saving). latest_checkpoint and the Estimator's and
    MonitoredSession's restore go through here."""
    if latest_filename is None and config.is_initialized():
        own = rank_state_filename(config.get_config().rank)
        if os.path.exists(os.path.join(checkpoint_dir, own)):
            latest_filename = own
    state = tf_get_checkpoint_state(checkpoint_dir, latest_filename)
    if state is None or not config.is_initialized():
        return state
    cfg = config.get_config()
    paths = list(state.all_model_checkpoint_paths)
    if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
        paths.append(state.model_checkpoint_path)
    for path in reversed(paths):
        if restorable(path, cfg):
            if path != state.model_checkpoint_path:
                log.warning("latest checkpoint: %s instead of %s, whose shards are not all committed",
                            path, state.model_checkpoint_path)
                state = type(state).FromString(state.SerializeToString())
                state.model_checkpoint_path = path
            return state
    return None


def tf_get_checkpoint_state(checkpoint_dir: str, latest_filename: str | None = None):
    """TensorFlow's own get_checkpoint_state (tf_patches.py installs this module's in its place)."""
    own = STATE.tf_get_checkpoint_state or checkpoint_management.get_checkpoint_state
    return own(checkpoint_dir, latest_filename)
