"""EvictHook: when every rank evicts (the user guide's "Model Adaptation"), in Session mode (MonitoredTrainingSession hooks)
and in Estimator mode (train hooks).

An eviction happens inside the training key exchange, in the same round on every rank, before the
next batch's keys are resolved; "at step N" means by the data of the first N training batches:
 - evict_step_interval: at every multiple of it. Every rank counts the same steps (from the global
   step the session starts at), so this needs no message and does not depend on how far the input
   pipeline runs ahead of training.
 - evict_time_interval (seconds of wall-clock time): rank 0's clock decides; its request travels
   in the next status round, so every rank evicts at the same batch.
An evicted key's row is not free at once: batches already looked up (prefetched) may still read and
update it, and a checkpoint saved at the step of the eviction still holds it (a restore there
evicts again). The row is held back, tagged with the step of the eviction, and freed once the
global step has passed that step; this hook reports the global step after every run, which also
lets the index drop the journal of steps trained (embedding_index.h). Evaluation and prediction
never evict.
"""
import time
from typing import Any

import tensorflow as tf

from ..process import config
from ..process.logs import get_logger
from ..validation import INT32_MAX, check_bool, check_int
from ..formats.channel import Channel
from ..process.world import get_world
from .steps import follow_global_step

log = get_logger("shardrec.eviction")
_OWNER = "EvictHook"


class EvictHook(tf.compat.v1.train.SessionRunHook):
    def __init__(self, evict_enable=True, evict_time_interval=24 * 60 * 60, evict_step_interval=None):
        self.evict_enable = check_bool(_OWNER, "evict_enable", evict_enable)
        self.evict_time_interval = None if evict_time_interval is None else check_int(
            _OWNER, "evict_time_interval", evict_time_interval, 1, INT32_MAX)
        self.evict_step_interval = None if evict_step_interval is None else check_int(
            _OWNER, "evict_step_interval", evict_step_interval, 1, INT32_MAX)
        if self.evict_enable and self.evict_time_interval is None and self.evict_step_interval is None:
            raise ValueError(f"{_OWNER}: evict_time_interval and evict_step_interval are both None; set at least "
                             "one (seconds, or global steps, in [1, 2^31-1])")
        self._tables = []
        self._global_step = None
        self._last = None

    def begin(self) -> None:
        if not self.evict_enable:
            return
        self._global_step = tf.compat.v1.train.get_global_step()
        if self._global_step is None:
            raise RuntimeError(f"{_OWNER}: the graph has no global step; create one "
                               "(tf.compat.v1.train.get_or_create_global_step()) and increment it in the train op, "
                               "as eviction counts steps with it")

    def after_create_session(self, session: tf.compat.v1.Session, coord: Any) -> None:
        if not self.evict_enable:
            return
        # Tables get their thresholds when the key pipeline starts, which GraphModifierHook may do
        # in a begin() after this one's.
        state = config.get_config().graph_state(session.graph)
        if not state.pipeline_started:
            raise RuntimeError(f"{_OWNER}: the key pipeline is not started in this graph; build the lookups and call "
                               "start_asc_pipeline() (in Estimator mode: add GraphModifierHook to the hooks)")
        self._tables = [t for t in state.tables.values() if t.thresholds is not None and t.thresholds.evicts]
        if not self._tables:
            log.warning("%s: no table of this graph has an eviction_threshold >= 0 on a training feature; "
                        "nothing will be evicted", _OWNER)
            return
        step = follow_global_step(session, self._tables)
        get_world().exchanges[Channel.TRAIN].set_eviction(self.evict_step_interval or 0)
        self._last = time.monotonic()
        log.info("eviction every %s for table(s) %s, from step %d", " or ".join(
            w for w in (self.evict_step_interval and f"{self.evict_step_interval} steps",
                        self.evict_time_interval and f"{self.evict_time_interval} s") if w),
            ", ".join(f"{t.table_name} (eviction_threshold {t.thresholds.eviction} s)" for t in self._tables), step)

    def end(self, session: tf.compat.v1.Session) -> None:
        # The channel outlives this graph (Estimator calls come and go): no schedule without the hook.
        if self._tables:
            get_world().exchanges[Channel.TRAIN].set_eviction(0)

    def before_run(self, run_context: Any) -> Any:
        if not self.evict_enable or not self._tables:
            return None
        return tf.compat.v1.train.SessionRunArgs(self._global_step)

    def after_run(self, run_context: Any, run_values: Any) -> None:
        if not self.evict_enable or not self._tables:
            return
        # The step read with the train op may be the value before its increment: freeing a step
        # later is safe, freeing early is not.
        trained = int(run_values.results)
        for table in self._tables:
            table.index.release_evicted(trained)
        if (self.evict_time_interval is not None and config.get_config().rank == 0
                and time.monotonic() - self._last >= self.evict_time_interval):
            get_world().exchanges[Channel.TRAIN].request_eviction()
            self._last = time.monotonic()
