"""Loggers whose every line carries the rank, e.g. ``[rank 1/4] shardrec.table: ...``."""
import logging
import os
import sys

from .state import STATE


def set_rank(rank: int, size: int) -> None:
    STATE.rank_text = f"rank {rank}/{size}"


class _RankFilter(logging.Filter):
    def filter(self, record):
        record.rank = STATE.rank_text
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
    if message not in STATE.warned:
        STATE.warned.add(message)
        get_logger(logger).warning(message)
