"""Loggers whose every line carries the rank, e.g. ``[rank 1/4] shardrec.table: ...``."""
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Set


@dataclass
class LogsState:
    """What every log line starts with, and the warnings already given once."""
    rank_text: str = "rank 0/1"
    warned: Set[str] = field(default_factory=set)


_STATE = LogsState()


def set_rank(rank: int, size: int) -> None:
    _STATE.rank_text = f"rank {rank}/{size}"


class _RankFilter(logging.Filter):
    def filter(self, record):
        record.rank = _STATE.rank_text
        return True


def get_logger(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    root = logging.getLogger("shardrec")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("[%(rank)s] %(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("SHARDREC_LOG_LEVEL", "INFO").upper())
        root.propagate = False
    return logger

def warn_once(message: str, logger: str = "shardrec") -> None:
    """Logs `message` as a warning the first time only (a parameter with no effect, say)."""
    if message not in _STATE.warned:
        _STATE.warned.add(message)
        get_logger(logger).warning(message)


def warned_once(message: str) -> bool:
    """Whether warn_once(message) was said in this process."""
    return message in _STATE.warned
