"""Loggers whose every line carries the rank, e.g. ``[rank 1/4] shardrec.table: ...``."""
import logging
import os
import sys

_rank_text = "rank 0/1"


def set_rank(rank, size):
    global _rank_text
    _rank_text = f"rank {rank}/{size}"


class _RankFilter(logging.Filter):
    def filter(self, record):
        record.rank = _rank_text
        return True


def get_logger(name):
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


_warned = set()


def warn_once(message, logger="shardrec"):
    """Logs `message` as a warning the first time only (a parameter with no effect, say)."""
    if message not in _warned:
        _warned.add(message)
        get_logger(logger).warning(message)
