"""Following a training job's model directory: every checkpoint listed in its state file (listed
only once every rank committed it), newer than the version served, is applied in step order; a
checkpoint that cannot be (damaged, removed, a broken chain) is refused with the reason in the log
and a metric, and the version served stays until a good one comes."""
import os
import re
import threading
import time
from typing import Any, Callable, List, Optional

import tensorflow as tf

from ...formats.checkpoint_chain import link_of
from ...formats.sparse_checkpoint import CheckpointError
from ...process.logs import get_logger
from .model_graph import ModelGraph
from .server_metrics import ServerMetrics
from .versions import Retired, ServedVersion, VersionInfo, apply_delta, builds_on, load_version

log = get_logger("shardrec.serve")
_STEP = re.compile(r"-(\d+)$")
_ERRORS = (CheckpointError, tf.errors.OpError, OSError, ValueError)


class NoVersion(Exception):
    """Nothing is served yet (no checkpoint could be loaded)."""


class Served:
    """The version requests run on; swapped whole, updated in place by the follower alone."""

    def __init__(self, graph: ModelGraph, metrics: ServerMetrics):
        self.graph, self.metrics = graph, metrics
        self.current: Optional[ServedVersion] = None
        # told of every version served (the gRPC health service turns SERVING at the first)
        self.listeners: List[Callable[[VersionInfo], None]] = []

    def run(self, fetches: Any, feeds: dict) -> tuple:
        for _ in range(100):
            version = self.current
            if version is None:
                raise NoVersion()
            try:
                return version.run(fetches, feeds)
            except Retired:
                time.sleep(0.01)
        raise NoVersion()

    @property
    def info(self) -> Optional[VersionInfo]:
        return self.current.info if self.current is not None else None

    def swap(self, version: ServedVersion) -> None:
        old, self.current = self.current, version
        self.record_served(version.info)
        if old is not None:
            old.retire()

    def record_served(self, info: VersionInfo) -> None:
        self.metrics.version.set(info.number)
        self.metrics.served_age.set(info.committed_at)
        self.metrics.commit_to_served.observe(max(0.0, info.served_at - info.committed_at))
        for listener in self.listeners:
            listener(info)


def listed_checkpoints(model_dir: str) -> list:
    """[(step, path)] of the checkpoints listed in `model_dir`'s state file, oldest first."""
    state = tf.train.get_checkpoint_state(model_dir)
    if state is None:
        return []
    found = {}
    for path in list(state.all_model_checkpoint_paths) + [state.model_checkpoint_path]:
        m = _STEP.search(path)
        if m:
            found[int(m.group(1))] = path if os.path.isabs(path) else os.path.join(model_dir, path)
    return sorted(found.items())


class Follower(threading.Thread):
    def __init__(self, served: Served, model_dir: str, poll_s: float = 0.5):
        super().__init__(name="shardrec-serve-follower", daemon=True)
        self.served, self.model_dir, self.poll_s = served, model_dir, poll_s
        self.refused = {}  # path -> the identity of the save refused there (its .index's mtime and size)
        self._halt = threading.Event()

    def load_newest(self) -> bool:
        """At start: the newest listed checkpoint that loads (older ones tried in turn)."""
        for step, path in reversed(listed_checkpoints(self.model_dir)):
            if self._apply(path, in_place=False):
                return True
        return False

    def run(self) -> None:
        while not self._halt.wait(self.poll_s):
            try:
                self.poll_once()
            except Exception:  # the thread must go on: the next poll retries
                log.exception("following %s", self.model_dir)

    def stop(self) -> None:
        self._halt.set()

    def poll_once(self) -> None:
        version = self.served.current
        if version is not None and version.damaged:
            self._apply(version.info.checkpoint, in_place=False)
        newest = self.served.info.number if self.served.info is not None else -1
        for step, path in listed_checkpoints(self.model_dir):
            if step > newest and self.refused.get(path) != _identity(path):
                if self._apply(path, in_place=True):
                    newest = step
        self.served.metrics.polls.inc()

    def _apply(self, path: str, in_place: bool) -> bool:
        started = time.monotonic()
        try:
            version = self.served.current
            link = link_of(path)
            if in_place and version is not None and not version.damaged and builds_on(link, version):
                info, how = apply_delta(version, link), "delta"
                self.served.record_served(info)
            else:
                loaded, how = load_version(self.served.graph, path), "full"
                self.served.swap(loaded)
                info = loaded.info
        except _ERRORS as e:
            self.refused[path] = _identity(path)
            self.served.metrics.refused.inc()
            kept = self.served.info
            log.error("checkpoint %s is not served: %s. Still serving %s", path, e,
                      f"version {kept.number} ({kept.checkpoint})" if kept else "nothing (no version loaded yet)")
            return False
        seconds = time.monotonic() - started
        self.served.metrics.updates.labels(how).inc()
        self.served.metrics.update_seconds.labels(how).observe(seconds)
        log.info("serving version %d (%s, %s in %.3f s; committed %.3f s before it was served)", info.number,
                 path, "a delta applied in place" if how == "delta" else "loaded whole", seconds,
                 info.served_at - info.committed_at)
        return True


def _identity(path: str):
    try:
        st = os.stat(f"{path}.index")
        return st.st_mtime_ns, st.st_size
    except OSError:
        return None
