"""The training key exchange numbers its batches by training step, from the global step a session
starts or resumes at: eviction by step interval counts them, and a checkpoint of global step T
takes back what the index counted for batches T, T+1, ... that the input pipeline looked up ahead
of training (embedding_index.h's journal). That needs one batch per global step, which Estimator
and MonitoredTrainingSession training gives; a session whose global step does not follow its
batches (or that has none) keeps the count of the batches looked up, and saves the index as it is.
"""
from typing import Any, Iterable, Optional

import tensorflow as tf

from ..formats.channel import Channel
from ..process.world import get_world


def counts_keys(tables: Iterable[Any]) -> bool:
    return any(t.thresholds is not None and t.thresholds.counts for t in tables)


def follow_global_step(session: tf.compat.v1.Session, tables: Iterable[Any]) -> Optional[int]:
    """Numbers the training batches from `session`'s global step, if the graph has one and some
    table counts keys. Returns the step, or None."""
    step = tf.compat.v1.train.get_global_step(session.graph)
    if step is None or not counts_keys(tables):
        return None
    value = int(session.run(step))
    get_world().exchanges[Channel.TRAIN].set_step(value)
    return value


def step_of_save(step: int | None) -> int | None:
    """The step a checkpoint's counts are taken back to: `step` when the batches are numbered by
    global step, else None (the index as it is)."""
    return step if step is not None and get_world().exchanges[Channel.TRAIN].step_follows_training else None
