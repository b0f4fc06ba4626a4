"""Which checkpoint is the latest: TensorFlow's state file, read through get_checkpoint_state,
which tf_patches.py installs in TensorFlow's place. A rank lists a checkpoint only after every
rank committed its shard, but a checkpoint written by a job that died mid-save (or whose shards
were deleted) may still be listed: it is skipped for the newest complete one. A delta of an incremental job is complete when its whole
chain is (checkpoint_chain.py).

init(restore_model_version=S) makes the first restore of the process load the checkpoint of step
S instead of the latest; later ones (an evaluation after training) see the latest again.
"""
import os
from typing import Any

from tensorflow.python.checkpoint import checkpoint_management

from ..process import config
from ..process.logs import get_logger, warn_once
from ..formats.checkpoint_chain import resolve
from ..formats.sparse_checkpoint import CheckpointError, needed_shards, sparse_dir

log = get_logger("shardrec.saver")
# TensorFlow's own, taken before tf_patches.py (which imports this module first) puts ours in its place.
_TF_GET_CHECKPOINT_STATE = checkpoint_management.get_checkpoint_state


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
        resolve(path, lambda root: needed_shards(root, cfg.rank, cfg.size))
    except CheckpointError as e:
        log.warning("checkpoint %s is not complete, skipped: %s", path, e)
        return False
    return True


def get_checkpoint_state(checkpoint_dir: str, latest_filename: str | None = None) -> Any:
    """TensorFlow's, except that model_checkpoint_path names the newest checkpoint whose table
    shards were all committed: rank 0 records a checkpoint before the other ranks may have
    finished theirs (or after one of them died saving). latest_checkpoint and the Estimator's and
    MonitoredSession's restore go through here."""
    if latest_filename is None and config.is_initialized():
        own = rank_state_filename(config.get_config().rank)
        if os.path.exists(os.path.join(checkpoint_dir, own)):
            latest_filename = own
    state = tf_get_checkpoint_state(checkpoint_dir, latest_filename)
    if state is None and config.is_initialized() and config.get_config().restore_model_version is not None:
        warn_once(f"init(restore_model_version={config.get_config().restore_model_version}): {checkpoint_dir} holds no "
                  "checkpoint yet; this run starts from freshly initialised variables", "shardrec.saver")
    if state is None or not config.is_initialized():
        return state
    cfg = config.get_config()
    paths = list(state.all_model_checkpoint_paths)
    if state.model_checkpoint_path and state.model_checkpoint_path not in paths:
        paths.append(state.model_checkpoint_path)
    if cfg.restore_model_version is not None and not cfg.loaded:
        return _of_step(state, paths, checkpoint_dir, cfg)
    for path in reversed(paths):
        if restorable(path, cfg):
            if path != state.model_checkpoint_path:
                log.warning("latest checkpoint: %s instead of %s, whose shards are not all committed",
                            path, state.model_checkpoint_path)
                state = type(state).FromString(state.SerializeToString())
                state.model_checkpoint_path = path
            return state
    return None


def _of_step(state, paths, checkpoint_dir, cfg):
    """The state with model_checkpoint_path at restore_model_version's step; a CheckpointError
    listing the steps there are when none of them is that step (or complete)."""
    wanted = cfg.restore_model_version
    steps = {}
    for path in paths:
        head, _, tail = path.rpartition("-")
        if head and tail.isdigit():
            steps.setdefault(int(tail), []).append(path)
    for path in reversed(steps.get(wanted, [])):
        if restorable(path, cfg):
            log.info("init(restore_model_version=%d): restoring %s", wanted, path)
            state = type(state).FromString(state.SerializeToString())
            state.model_checkpoint_path = path
            return state
    found = "not complete (see the warning above)" if wanted in steps else "not there"
    raise CheckpointError(f"init(restore_model_version={wanted}): the checkpoint of step {wanted} in {checkpoint_dir} is "
                          f"{found}; the steps listed there are {sorted(steps) or 'none'}. Pick one of them, or leave "
                          "restore_model_version out to restore the latest")


def tf_get_checkpoint_state(checkpoint_dir: str, latest_filename: str | None = None) -> Any:
    """TensorFlow's own get_checkpoint_state (tf_patches.py installs this module's in its place)."""
    return _TF_GET_CHECKPOINT_STATE(checkpoint_dir, latest_filename)
