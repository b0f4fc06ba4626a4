"""Estimator mode: shardrec's counterpart of the Rec SDK's NPUEstimator, a drop-in for
tf.estimator.Estimator that runs train, evaluate, predict and train_and_evaluate on every rank.

Every rank runs the same Estimator on its own shard of the data, with one shared model_dir:
- model_fn runs in the Estimator's own graph for every call, so tables are created inside it
  (each graph's tables get their key index back from the checkpoint);
- the key pipeline is started (or the graph modified, for modify_graph=True lookups) by a
  GraphModifierHook added to every mode;
- dense variables start equal on every rank (broadcast from rank 0 once the session exists);
  dense gradients are averaged by the model_fn's hvd.DistributedOptimizer, as in Session mode;
- rank 0 writes the dense checkpoints and the training summaries; every rank writes its shard of
  every table at the same steps (sparse_checkpoint.py), and restores dense + its shard. Each rank
  evaluates its own data, and tf.estimator writes every rank's eval metrics under model_dir/eval
  (Estimator forbids overriding eval_dir).
Checkpoints are taken by step (save_checkpoints_steps): a time-based schedule would fire at
different steps on different ranks, and a checkpoint needs every rank's shard of the same step.
With init(is_incremental_checkpoint=True) they follow init's timers, at steps every rank agrees on
(save_schedule.py).
"""

import os
import shutil

import tensorflow as tf
from tensorflow.python.training import training_util
from tensorflow.python.util import function_utils

from ..process import config
from ..checkpoint import warm_start
from .hooks import GraphModifierHook
from ..process.logs import get_logger
from ..serving import export as serving_export
from ..embedding.table import SPARSE_SLOTS_COLLECTION, SPARSE_TABLES_COLLECTION

log = get_logger("shardrec.estimator")

DEFAULT_SAVE_STEPS = 1000


class _BroadcastDenseHook(tf.compat.v1.train.SessionRunHook):
    """Rank 0's dense variables to every rank once the session exists (after any restore)."""

    def begin(self):
        import horovod.tensorflow as hvd

        sparse = {id(v) for c in (SPARSE_TABLES_COLLECTION, SPARSE_SLOTS_COLLECTION)
                  for v in tf.compat.v1.get_collection(c)}
        dense = [v for v in tf.compat.v1.global_variables() if id(v) not in sparse]
        self._op = hvd.broadcast_variables(dense, root_rank=0) if dense else None

    def after_create_session(self, session, coord):
        if self._op is not None:
            session.run(self._op)


class _NoSummaries:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class _ShardSaverHook(tf.compat.v1.train.CheckpointSaverHook):
    """On ranks other than 0: TensorFlow's CheckpointSaverHook (same schedule as rank 0's, and the
    hook train_and_evaluate attaches its evaluation listener to), whose saves write this rank's
    table shards only (the Saver skips the dense part there) and no summaries."""

    def begin(self):
        # CheckpointSaverHook.begin without its summary writer, which would create an event file.
        self._summary_writer = _NoSummaries()
        self._global_step_tensor = training_util._get_or_create_global_step_read()
        if self._global_step_tensor is None:
            raise RuntimeError("Global step should be created to use CheckpointSaverHook.")
        for listener in self._listeners:
            listener.begin()


def _rank_config(run_config, rank):
    if run_config.save_checkpoints_steps is None:
        if config.get_config().incremental is not None:
            pass  # the checkpoint hook follows init's incremental timers (save_schedule.py) instead
        elif run_config.save_checkpoints_secs:
            log.warning("save_checkpoints_secs=%s: shardrec's Estimator saves by step so that every rank saves the "
                        "same step; using save_checkpoints_steps=%d", run_config.save_checkpoints_secs,
                        DEFAULT_SAVE_STEPS)
        run_config = run_config.replace(save_checkpoints_steps=DEFAULT_SAVE_STEPS, save_checkpoints_secs=None)
    if rank > 0:
        # Rank 0 writes the dense checkpoints and the summaries; the others save shards by hook.
        run_config = run_config.replace(save_summary_steps=0, log_step_count_steps=None)
    return run_config


class Estimator(tf.estimator.Estimator):
    """tf.estimator.Estimator for shardrec models; call shardrec's init() first."""

    def __init__(self, model_fn, model_dir=None, config=None, params=None, warm_start_from=None):
        cfg = _runtime_config()
        self._rank = cfg.rank
        run_config = config or tf.estimator.RunConfig()
        user_fn = model_fn
        user_args = set(function_utils.fn_args(user_fn))
        estimator = self
        # The checkpoint export_saved_model reads, while it builds its graph (None: not exporting).
        self._exporting_from = None

        def shardrec_model_fn(features, labels, mode, params, config):
            export = None
            if estimator._exporting_from is not None:  # the graph TensorFlow builds for the export
                export = serving_export.export_in(tf.compat.v1.get_default_graph(), estimator._exporting_from)
            kwargs = {"features": features, "labels": labels, "mode": mode, "params": params, "config": config}
            spec = user_fn(**{k: v for k, v in kwargs.items() if k in user_args})
            if export is not None:
                return _export_spec(spec, export, features)
            return estimator._add_rank_hooks(spec, mode)

        # Warm start covers tables and list-valued settings (the user guide's "Custom WarmStart"), so shardrec applies it
        # itself (warm_start.py) instead of tf.estimator.
        self._warm_start = None
        if warm_start_from is not None:
            warm_start.entries(warm_start_from)  # a bad setting fails here, not at the first train()
            self._warm_start = warm_start_from
        super().__init__(model_fn=shardrec_model_fn, model_dir=model_dir, config=_rank_config(run_config, cfg.rank),
                         params=params)

    def _export_all_saved_models(self, export_dir_base, input_receiver_fn_map, assets_extra=None, as_text=False,
                                 checkpoint_path=None, strip_default_attrs=True):
        """export_saved_model's work (Estimator forbids overriding export_saved_model itself): the
        PREDICT graph rebuilt with stock lookups (serving/), on this process alone. In a job of
        several ranks rank 0 exports and the others return None: scripts run the same lines on every
        rank, and TensorFlow's timestamped directories would collide (the same second on each)."""
        if self._rank > 0:
            log.info("export_saved_model: rank 0 writes the SavedModel (it reads every rank's shard); this rank "
                     "returns None")
            return None
        checkpoint_path = serving_export.resolve_checkpoint(checkpoint_path or self.model_dir)
        base = os.fsdecode(export_dir_base)
        before = set(os.listdir(base)) if os.path.isdir(base) else set()
        self._exporting_from = checkpoint_path
        try:
            return super()._export_all_saved_models(
                export_dir_base, input_receiver_fn_map, assets_extra=assets_extra, as_text=as_text,
                checkpoint_path=checkpoint_path, strip_default_attrs=strip_default_attrs)
        except BaseException:
            # TensorFlow leaves its half-written temp-<timestamp> directory behind when an export fails.
            for entry in set(os.listdir(base)) - before if os.path.isdir(base) else ():
                if entry.startswith("temp-"):
                    shutil.rmtree(os.path.join(base, entry), ignore_errors=True)
            raise
        finally:
            self._exporting_from = None

    def _add_rank_hooks(self, spec, mode):
        state = _runtime_config().graph_state()
        hooks = [GraphModifierHook(modify_graph=bool(state.pending_lookups))]
        if mode == tf.estimator.ModeKeys.TRAIN:
            if self._warm_start is not None:
                hooks.append(warm_start.WarmStartHook(self._warm_start, self.model_dir))
            hooks.append(_BroadcastDenseHook())
            chief = list(spec.training_chief_hooks)
            if self._rank > 0:
                chief.append(_ShardSaverHook(self.model_dir, save_steps=self.config.save_checkpoints_steps,
                                             scaffold=spec.scaffold, save_graph_def=False))
            return spec._replace(training_hooks=list(spec.training_hooks) + hooks, training_chief_hooks=chief)
        if mode == tf.estimator.ModeKeys.EVAL:
            return spec._replace(evaluation_hooks=list(spec.evaluation_hooks) + hooks)
        return spec._replace(prediction_hooks=list(spec.prediction_hooks) + hooks)


def _export_spec(spec, exporting, features):
    """The PREDICT spec of an export: no hooks (nothing of the key pipeline runs), and a scaffold
    whose saver fills the stock tables from the checkpoint and saves them with the dense variables."""
    if spec.mode != tf.estimator.ModeKeys.PREDICT:
        raise ValueError(f"export_saved_model: exports the PREDICT graph; model_fn returned a {spec.mode} spec")
    if isinstance(features, dict):
        predictions = spec.predictions.values() if isinstance(spec.predictions, dict) else [spec.predictions]
        unread = serving_export.unread_features(exporting, features, predictions)
        if unread:
            raise ValueError(f"export_saved_model: the serving receiver's feature(s) {unread} are not used by the "
                             f"model (nothing in its graph reads them); the receiver has {sorted(features)}")
    scaffold = tf.compat.v1.train.Scaffold(saver=serving_export.ExportSaver(exporting),
                                           local_init_op=tf.group(tf.compat.v1.local_variables_initializer(),
                                                                  tf.compat.v1.tables_initializer()))
    return spec._replace(scaffold=scaffold, prediction_hooks=[])


def _runtime_config():
    if not config.is_initialized():
        raise RuntimeError("Estimator: shardrec is not initialised; call init() before creating the Estimator")
    return config.get_config()
