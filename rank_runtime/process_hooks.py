"""What init() changes outside shardrec's own objects, never an import: TensorFlow patches
(Dataset.map, the Saver, get_checkpoint_state) and environment defaults for ranks that share a
host. The hooks that end the whole job when one rank fails are exit_hooks.py's.
"""
import os

from .logs import get_logger

log = get_logger("shardrec.process")

_applied = set()


def patch_tensorflow():
    """Dataset.map recognises the insert function; tf.compat.v1.train.Saver (and the class the
    Estimator's Scaffold uses) becomes shardrec's Saver; get_checkpoint_state skips checkpoints
    whose table shards are incomplete. Idempotent."""
    if "tensorflow" in _applied:
        return
    import tensorflow as tf
    from tensorflow.python.checkpoint import checkpoint_management
    from tensorflow.python.data.ops import dataset_ops
    from tensorflow.python.training import saver as saver_lib

    from . import key_pipeline, saver

    for cls in (dataset_ops.DatasetV2, dataset_ops.DatasetV1):
        _wrap_map(cls, key_pipeline.InsertFunction, dataset_ops)
    saver_lib.Saver = tf.compat.v1.train.Saver = saver.Saver
    saver.set_tf_get_checkpoint_state(checkpoint_management.get_checkpoint_state)
    checkpoint_management.get_checkpoint_state = saver.get_checkpoint_state
    tf.train.get_checkpoint_state = tf.compat.v1.train.get_checkpoint_state = saver.get_checkpoint_state
    _applied.add("tensorflow")


def _wrap_map(cls, insert_function_type, dataset_ops):
    original = cls.__dict__["map"]
    if getattr(original, "_shardrec_wrapped", False):
        return

    def map(self, map_func, *args, **kwargs):  # noqa: A001 - it is Dataset.map
        if isinstance(map_func, insert_function_type):
            out = map_func.apply(self, *args, **kwargs)
            return dataset_ops.DatasetV1Adapter(out) if isinstance(self, dataset_ops.DatasetV1) else out
        return original(self, map_func, *args, **kwargs)

    map.__doc__ = original.__doc__
    map._shardrec_wrapped = True
    cls.map = map


def share_cores(local_size, exchange_timeout_s):
    """Defaults for ranks that share a host. TensorFlow sizes its thread pools for every core of
    the machine, and N ranks doing so fight over the cores (measured in bench/: 2 ranks on 2 cores
    went from 3.4M to 4.6M ids/s); Horovod's negotiation cycle is shortened because each step waits
    on two row all-to-alls. Horovod stops a collective that some rank never joins after the key
    exchange's timeout, as the exchange does. Values the user set are kept; TensorFlow reads these
    when its first session starts, so init() must come before it."""
    limit = int(max(1, exchange_timeout_s))
    # Horovod looks for stalled collectives every STALL_CHECK seconds (a warning naming the
    # missing ranks) and ends the job once one has stalled STALL_SHUTDOWN seconds.
    defaults = {"HOROVOD_STALL_CHECK_TIME_SECONDS": str(min(60, limit)), "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(limit)}
    if local_size > 1:
        import psutil

        cores = len(psutil.Process().cpu_affinity())
        per_rank = str(max(1, cores // local_size))
        defaults.update(TF_NUM_INTRAOP_THREADS=per_rank, TF_NUM_INTEROP_THREADS=per_rank, HOROVOD_CYCLE_TIME="0.2")
        log.info("%d ranks share this host's %d cores", local_size, cores)
    applied = {k: v for k, v in defaults.items() if k not in os.environ}
    os.environ.update(applied)
    if applied:
        log.info("defaults applied: %s", " ".join(f"{k}={v}" for k, v in applied.items()))
