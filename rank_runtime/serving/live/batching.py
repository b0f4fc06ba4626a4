"""Server-side batching of concurrent predict requests, with TF Serving's knobs and their defaults
(its BasicBatchScheduler's options: `--enable_batching` with a batching parameters file there,
flags of shardrec-serve here). Requests on one signature whose inputs agree past the batch
dimension queue together; a batch thread takes the oldest and every later one that fits in
`max_batch_size` instances, once the batch is full or the oldest has waited `batch_timeout_micros`
(0: whatever is queued when a thread is free, which is how batches form under load without delaying
a lone request), concatenates their inputs and runs them as one `session.run` on one version; each
request gets its own rows of every output and that version."""
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from .model_graph import Signature

RunFn = Callable[[Signature, Dict[str, np.ndarray]], Tuple[Dict[str, np.ndarray], Any]]


@dataclass(frozen=True)
class BatchOptions:
    max_batch_size: int = 1000
    batch_timeout_micros: int = 0
    num_batch_threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    max_enqueued_batches: int = 10

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.batch_timeout_micros < 0 or self.num_batch_threads < 1 \
                or self.max_enqueued_batches < 1:
            raise ValueError(f"batching options {self}: max_batch_size, num_batch_threads and "
                             "max_enqueued_batches must be >= 1, batch_timeout_micros >= 0")


class QueueFull(Exception):
    """More than max_enqueued_batches batches of requests wait: the request is refused, not queued."""


class _Task:
    __slots__ = ("signature", "feeds", "size", "key", "enqueued", "done", "outputs", "info", "error")

    def __init__(self, signature: Signature, feeds: Dict[str, np.ndarray], size: int, key: tuple):
        self.signature, self.feeds, self.size, self.key = signature, feeds, size, key
        self.enqueued = time.monotonic()
        self.done = threading.Event()
        self.outputs: Optional[Dict[str, np.ndarray]] = None
        self.info: Any = None
        self.error: Optional[BaseException] = None


class Batcher:
    """Runs requests through `run(signature, feeds) -> (outputs, version info)`, batched."""

    def __init__(self, run: RunFn, options: BatchOptions, on_batch: Optional[Callable[[int], None]] = None):
        self._run, self.options, self._on_batch = run, options, on_batch or (lambda requests: None)
        self._queue: Deque[_Task] = deque()
        self._queued = 0  # instances waiting
        self._cond = threading.Condition()
        self._closed = False
        self._unbatched: set = set()  # keys of signatures whose outputs turned out not to split per request
        self._threads = [threading.Thread(target=self._loop, name=f"shardrec-serve-batch-{i}", daemon=True)
                         for i in range(options.num_batch_threads)]
        for t in self._threads:
            t.start()

    def run(self, signature: Signature, feeds: Dict[str, np.ndarray]) -> Tuple[Dict[str, np.ndarray], Any]:
        size = int(next(iter(feeds.values())).shape[0])
        key = (signature.name,) + tuple((a, v.shape[1:], v.dtype.str) for a, v in sorted(feeds.items()))
        if size > self.options.max_batch_size or key in self._unbatched:
            self._on_batch(1)
            return self._run(signature, feeds)  # a request larger than a batch runs alone, unsplit
        task = _Task(signature, feeds, size, key)
        limit = self.options.max_enqueued_batches * self.options.max_batch_size
        with self._cond:
            if self._queued + size > limit:
                raise QueueFull(f"the batch queue is full ({self._queued} instances wait, at most "
                                f"{self.options.max_enqueued_batches} batches of {self.options.max_batch_size}: "
                                "shardrec-serve --max-enqueued-batches); try again")
            self._queue.append(task)
            self._queued += size
            self._cond.notify()
        task.done.wait()
        if task.error is not None:
            raise task.error
        assert task.outputs is not None
        return task.outputs, task.info

    def close(self) -> None:
        """Stops the batch threads; requests still queued hear QueueFull (the server is going away)."""
        with self._cond:
            self._closed = True
            left, self._queue, self._queued = list(self._queue), deque(), 0
            self._cond.notify_all()
        for t in left:
            t.error = QueueFull("the server is stopping; try again")
            t.done.set()

    def _take(self) -> Optional[List[_Task]]:
        timeout = self.options.batch_timeout_micros / 1e6
        with self._cond:
            while True:
                if self._closed:
                    return None
                if not self._queue:
                    self._cond.wait()
                    continue
                head = self._queue[0]
                waiting = sum(t.size for t in self._queue if t.key == head.key)
                left = head.enqueued + timeout - time.monotonic()
                if waiting < self.options.max_batch_size and left > 0:
                    self._cond.wait(left)
                    continue
                batch, total, kept = [], 0, deque()
                for t in self._queue:
                    if t.key == head.key and total + t.size <= self.options.max_batch_size:
                        batch.append(t)
                        total += t.size
                    else:
                        kept.append(t)
                self._queue, self._queued = kept, self._queued - total
                return batch

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                self._run_batch(batch)
            except BaseException as e:  # every request of the batch hears why
                for t in batch:
                    t.error = e
            finally:
                for t in batch:
                    t.done.set()

    def _run_each(self, batch: List[_Task]) -> None:
        for t in batch:
            try:
                t.outputs, t.info = self._run(t.signature, t.feeds)
            except Exception as e:
                t.error = e
            self._on_batch(1)

    def _run_batch(self, batch: List[_Task]) -> None:
        first = batch[0]
        if len(batch) == 1:
            first.outputs, first.info = self._run(first.signature, first.feeds)
            self._on_batch(1)
            return
        feeds = {alias: np.concatenate([t.feeds[alias] for t in batch]) for alias in first.feeds}
        total = sum(t.size for t in batch)
        try:
            outputs, info = self._run(first.signature, feeds)
        except Exception:
            # One request the model refuses must not fail the others: each runs alone, and hears
            # its own answer.
            self._run_each(batch)
            return
        if any(v.ndim == 0 or v.shape[0] != total for v in outputs.values()):
            # An output that is not one row per instance (a reduction over the batch): this
            # signature's requests run alone from now on.
            self._unbatched.add(first.key)
            self._run_each(batch)
            return
        self._on_batch(len(batch))
        bounds = np.cumsum([t.size for t in batch])[:-1]
        parts = {alias: np.split(v, bounds) for alias, v in outputs.items()}
        for i, t in enumerate(batch):
            t.outputs, t.info = {alias: p[i] for alias, p in parts.items()}, info
