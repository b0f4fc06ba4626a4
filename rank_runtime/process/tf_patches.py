"""What init() changes in TensorFlow, never an import: Dataset.map recognises the insert function,
the Saver becomes shardrec's, get_checkpoint_state skips uncommitted checkpoints, a session's close
closes its key pipeline's passes (key_pipeline.close_passes), a gradient first builds the graph's
table groups (table_groups.build). The environment
defaults for ranks sharing a host are host_defaults.py's; the hooks that end the whole job when one
rank fails are exit_hooks.py's.
"""
from dataclasses import dataclass

import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management
from tensorflow.python.client import session as session_lib
from tensorflow.python.data.ops import dataset_ops
from tensorflow.python.ops import gradients_util
from tensorflow.python.training import saver as saver_lib

from ..checkpoint import checkpoint_state, saver
from . import config
from ..pipeline import key_pipeline, table_groups
from ..checkpoint.save_schedule import AgreedSaveTimer


@dataclass
class PatchState:
    patched: bool = False  # once per process


_STATE = PatchState()


def patch_tensorflow() -> None:
    """Dataset.map recognises the insert function; tf.compat.v1.train.Saver (and the class the
    Estimator's Scaffold uses) becomes shardrec's Saver; get_checkpoint_state skips checkpoints
    whose table shards are incomplete. Idempotent."""
    if _STATE.patched:
        return
    for cls in (dataset_ops.DatasetV2, dataset_ops.DatasetV1):
        _wrap_map(cls)
    saver_lib.Saver = tf.compat.v1.train.Saver = saver.Saver
    checkpoint_management.get_checkpoint_state = checkpoint_state.get_checkpoint_state
    tf.train.get_checkpoint_state = tf.compat.v1.train.get_checkpoint_state = checkpoint_state.get_checkpoint_state
    _follow_agreed_saves(tf.compat.v1.train.CheckpointSaverHook)
    _close_passes_with_sessions(session_lib.BaseSession)
    _build_groups_before_gradients()
    _STATE.patched = True


def _build_groups_before_gradients():
    """tf.gradients, tf.compat.v1.gradients and every optimizer's compute_gradients go through
    TensorFlow's one gradient builder: the table groups of the default graph are built first, so
    the gradient meets their ops, not the stand-ins their lookups returned (table_groups.py)."""
    original = gradients_util._GradientsHelper  # noqa: SLF001 - the builder TensorFlow's gradient functions call
    if getattr(original, "_shardrec_wrapped", False):
        return

    def helper(*args, **kwargs):
        if config.is_initialized():
            table_groups.build(tf.compat.v1.get_default_graph())
        return original(*args, **kwargs)

    helper._shardrec_wrapped = True
    gradients_util._GradientsHelper = helper  # noqa: SLF001


def _close_passes_with_sessions(cls):
    """Session.close() (a with block's end, MonitoredSession's, every Estimator call's) closes the
    key pipeline's passes of its graph around TensorFlow's close (key_pipeline.close_passes). A
    session collected without close() is closed by its __del__ whenever the garbage collector runs,
    maybe while a newer session of the same graph runs: that close leaves the channels alone."""
    original_close, original_del = cls.close, cls.__del__

    def close(self):
        if not self._session or self._closed or getattr(self, "_shardrec_collected", False):
            return original_close(self)
        closed = key_pipeline.close_passes(self.graph)
        try:
            return original_close(self)
        finally:
            key_pipeline.reopen_passes(closed)

    def __del__(self):
        self._shardrec_collected = True
        original_del(self)

    cls.close, cls.__del__ = close, __del__


def _follow_agreed_saves(cls):
    """In an incremental job, CheckpointSaverHook (MonitoredTrainingSession's, the Estimator's)
    saves at the steps every rank agreed on (save_schedule.AgreedSaveTimer) instead of its own
    save_secs / save_steps."""
    original = cls.__init__
    if getattr(original, "_shardrec_wrapped", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if config.is_initialized() and config.get_config().incremental is not None:
            self._timer = AgreedSaveTimer(self)

    __init__._shardrec_wrapped = True
    cls.__init__ = __init__


def _wrap_map(cls):
    original = cls.__dict__["map"]
    if getattr(original, "_shardrec_wrapped", False):
        return

    def map(self, map_func, *args, **kwargs):  # noqa: A001 - it is Dataset.map
        if isinstance(map_func, key_pipeline.InsertFunction):
            out = map_func.apply(self, *args, **kwargs)
            return dataset_ops.DatasetV1Adapter(out) if isinstance(self, dataset_ops.DatasetV1) else out
        return original(self, map_func, *args, **kwargs)

    map.__doc__ = original.__doc__
    map._shardrec_wrapped = True
    cls.map = map
