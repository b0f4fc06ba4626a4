"""Every rank learns, in the same round, whether every rank's attempt at a step succeeded: what a
save's and a restore's steps need so that one rank's failure (a full disk, a damaged file) stops
every rank with the same error naming it, and no rank commits or loads alone.
"""
from dataclasses import dataclass
from typing import Any, Callable, Optional

import tensorflow as tf

from ..process import config
from ..formats.sparse_checkpoint import CheckpointError
from ..process.world import get_world

# The longest a rank waits for the others at a save's or a restore's agreement (seconds).
AGREE_TIMEOUT_S = 120


@dataclass(frozen=True)
class RankResult:
    """This rank's part of a checkpoint step: its value, or the error that stopped it."""
    value: Any
    error: Optional[BaseException]


def attempt(fn: Callable[[], Any]) -> RankResult:
    """fn()'s value, or the error of a checkpoint step (I/O, a bad file, a TensorFlow op)."""
    try:
        return RankResult(fn(), None)
    except (CheckpointError, OSError, ValueError, tf.errors.OpError) as e:
        return RankResult(None, e)


def agree(what: str, outcome: RankResult, consequence: str) -> None:
    """Every rank learns whether every rank's attempt succeeded; if any failed, every rank raises
    a CheckpointError naming each failing rank and its error, then `consequence`."""
    cfg = config.get_config()
    if cfg.size == 1:
        if outcome.error is not None:
            raise outcome.error
        return
    world = get_world()
    failed = world.gather_from_ranks(int(outcome.error is not None), what, timeout=AGREE_TIMEOUT_S)
    if not any(failed):
        return
    texts = world.gather_texts("" if outcome.error is None else str(outcome.error), what, timeout=AGREE_TIMEOUT_S)
    reasons = "; ".join(f"rank {r}: {text}" for r, text in enumerate(texts) if failed[r])
    raise CheckpointError(f"{what} failed on rank(s) {[r for r, f in enumerate(failed) if f]} ({reasons}); "
                          f"{consequence}") from outcome.error
