"""Live figures of a rank for operators: a Prometheus endpoint (prometheus_client, off by default)
and progress lines in the log, from the same snapshot.

    SHARDREC_METRICS_PORT=9400                 the endpoint on rank 0, http://ADDR:9400/metrics
    SHARDREC_METRICS_EVERY_RANK=1              on every rank, each on PORT + its local rank
    SHARDREC_METRICS_ADDR=0.0.0.0              where it listens (default 127.0.0.1: this host only)
    SHARDREC_PROGRESS_S=30                     seconds between progress lines of a stream job (0: none)

The training step pays a few native counter reads per batch while an endpoint or progress lines
read them (batch_trained, on the key pipeline's thread, which alone grows the tables), one
addition otherwise; a stream's lag (partitions, the broker) is read
when a scrape or a progress line asks for it. Each rank serves its own figures (its partitions, its shards of the
tables); the supervisor's restarts and resizes reach every rank in its environment.
"""
import dataclasses
import os
import threading
import time
from typing import Any, Dict, Iterable, Mapping, Optional, Protocol, Tuple, runtime_checkable

from ..formats.heartbeat_format import ATTEMPT_ENV, RESIZES_ENV, RESTARTS_ENV
from ..formats.channel import Channel
from . import batch_events
from .logs import get_logger

log = get_logger("shardrec.metrics")
PORT_ENV, EVERY_RANK_ENV, ADDR_ENV, PROGRESS_ENV = ("SHARDREC_METRICS_PORT", "SHARDREC_METRICS_EVERY_RANK",
                                                    "SHARDREC_METRICS_ADDR", "SHARDREC_PROGRESS_S")
REFRESH_S = 1.0


@dataclasses.dataclass(frozen=True)
class SaveFigures:
    step: int
    kind: str  # "full" or "delta"
    bytes: int
    at: float  # time.time() when it was committed


@runtime_checkable
class StreamLag(Protocol):
    """The stream this process trains from, as metrics reads it: a batch observer (stream/partitioned.py's
    PartitionedStream registers itself) whose lag() is {partition: figures with records, seconds, trained}."""

    def lag(self) -> Mapping[str, Any]: ...


@dataclasses.dataclass
class MetricsState:
    """Samples trained, the tables' figures as last read (name -> rows, admitted, evicted), the last
    save; the endpoint's (server, thread, port) and the progress lines' thread."""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    samples: int = 0
    rate: float = 0.0  # samples/s over the last refresh interval
    rate_from: Tuple[float, int] = (0.0, 0)  # (monotonic time, samples) the rate is measured from
    tables: Dict[str, dict] = dataclasses.field(default_factory=dict)
    last_save: Optional[SaveFigures] = None
    server: Optional[Tuple[Any, threading.Thread, int]] = None  # prometheus_client's server, its thread, the port
    progress_thread: Optional[threading.Thread] = None
    progress_tables: Dict[str, dict] = dataclasses.field(default_factory=dict)  # as at the last progress line


_STATE = MetricsState()


def batch_trained(samples: int, tables: Iterable[Any]) -> None:
    """The key pipeline exchanged a training batch of `samples` (on its thread, which alone grows
    the tables: their figures are read here, a few native counters, so that a scrape after the
    last batch sees that batch's)."""
    state = _STATE
    if state.server is None and state.progress_thread is None:  # nobody reads the figures
        state.samples += samples
        return
    figures = {}
    for table in tables:
        counters = table.index.counters()
        figures[table.table_name] = {"rows": table.size(), "admitted": counters.admitted,
                                     "evicted": counters.evicted}
    now = time.monotonic()
    with state.lock:
        state.samples += samples
        state.tables = figures
        since, before = state.rate_from
        if now - since >= REFRESH_S:
            state.rate = (state.samples - before) / (now - since) if since else 0.0
            state.rate_from = (now, state.samples)


def start_progress_lines() -> None:
    """A stream job's progress lines, every SHARDREC_PROGRESS_S seconds, from a thread of their own:
    a stream's lag may read the broker or count new files, which the step must not wait for."""
    interval = _progress_interval()
    if not interval or _STATE.progress_thread is not None:
        return

    def lines():
        while True:
            time.sleep(interval)
            if _training_stream() is None:
                continue
            try:
                log.info("progress: %s", progress_line())
            except Exception as e:  # noqa: BLE001 - a progress line never ends the job
                log.warning("progress line failed: %s", e)

    _STATE.progress_thread = threading.Thread(target=lines, name="shardrec-progress", daemon=True)
    _STATE.progress_thread.start()


def saved(step: int, kind: str, shard_dir: str) -> None:
    """A save committed this rank's shard (its files under shard_dir)."""
    size = 0
    for folder, _, files in os.walk(shard_dir):
        for name in files:
            try:
                size += os.path.getsize(os.path.join(folder, name))
            except OSError:
                pass
    _STATE.last_save = SaveFigures(step, kind, size, time.time())


def _progress_interval() -> float:
    text = os.environ.get(PROGRESS_ENV, "30")
    try:
        return max(0.0, float(text))
    except ValueError:
        return 30.0


def _training_stream() -> Optional[StreamLag]:
    return next((o for o in batch_events.observers() if isinstance(o, StreamLag)), None)


def _lag():
    stream = _training_stream()
    if stream is None:
        return {}
    try:
        return stream.lag()
    except Exception as e:  # noqa: BLE001 - a broker away: the figures say so, the step goes on
        log.warning("stream lag unknown (%s)", e)
        return {}


def progress_line() -> str:
    """samples/s, the stream's lag, the last save, rows and admissions/evictions since the last line."""
    state = _STATE
    with state.lock:
        rate, samples, tables, save = state.rate, state.samples, dict(state.tables), state.last_save
        before_tables, state.progress_tables = state.progress_tables, tables
    parts = [f"{rate:.0f} samples/s, {samples} samples"]
    lag = _lag()
    if lag:
        parts.append("lag " + ", ".join(f"partition {p}: {v.records} records, {v.seconds:.1f} s behind"
                                        for p, v in sorted(lag.items())))
    if save is not None:
        parts.append(f"last save step {save.step} ({save.kind}, {save.bytes / 2**20:.1f} MiB, "
                     f"{time.time() - save.at:.0f} s ago)")
    for name, t in sorted(tables.items()):
        before = before_tables.get(name, {"admitted": 0, "evicted": 0})
        parts.append(f"table {name}: {t['rows']} rows, +{t['admitted'] - before['admitted']} admitted, "
                     f"+{t['evicted'] - before['evicted']} evicted")
    return "; ".join(parts)


class _Collector:
    """Reads the figures when Prometheus scrapes (prometheus_client's custom collector)."""

    def __init__(self, rank: int):
        self.rank = str(rank)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state, rank = _STATE, self.rank
        with state.lock:
            rate, samples, tables, save = state.rate, state.samples, dict(state.tables), state.last_save

        def family(kind, name, doc, labels=()):
            return kind(name, doc, labels=["rank", *labels])

        out = family(CounterMetricFamily, "shardrec_samples", "samples this rank trained")
        out.add_metric([rank], samples)
        yield out
        out = family(GaugeMetricFamily, "shardrec_samples_per_second", "samples/s over the last second or more")
        out.add_metric([rank], rate)
        yield out
        lag = _lag()
        gauges = {what: family(GaugeMetricFamily, f"shardrec_stream_{what}", doc, ["partition"]) for what, doc in (
            ("lag_records", "records of the partition not trained yet"),
            ("lag_seconds", "seconds between the newest record of the partition and the last one trained"),
            ("trained_records", "records of the partition that training took"))}
        for partition, v in sorted(lag.items()):
            gauges["lag_records"].add_metric([rank, partition], v.records)
            gauges["lag_seconds"].add_metric([rank, partition], v.seconds)
            gauges["trained_records"].add_metric([rank, partition], v.trained)
        yield from gauges.values()
        if save is not None:
            for name, value, doc in (("step", save.step, "global step of the last save"),
                                     ("bytes", save.bytes, "bytes of this rank's shard of the last save"),
                                     ("age_seconds", time.time() - save.at, "seconds since the last save")):
                out = family(GaugeMetricFamily, f"shardrec_last_save_{name}", doc, ["kind"])
                out.add_metric([rank, save.kind], value)
                yield out
        rows = family(GaugeMetricFamily, "shardrec_table_rows", "keys this rank's shard of the table holds",
                      ["table"])
        admitted = family(CounterMetricFamily, "shardrec_admitted", "keys admitted (given a row)", ["table"])
        evicted = family(CounterMetricFamily, "shardrec_evicted", "keys evicted", ["table"])
        for name, t in sorted(tables.items()):
            rows.add_metric([rank, name], t["rows"])
            admitted.add_metric([rank, name], t["admitted"])
            evicted.add_metric([rank, name], t["evicted"])
        yield from (rows, admitted, evicted)
        for name, env, doc in (("restarts", RESTARTS_ENV, "restarts after a failure, by the supervisor"),
                               ("resizes", RESIZES_ENV, "resizes of an elastic job, by the supervisor"),
                               ("attempt", ATTEMPT_ENV, "the supervisor's attempt this process belongs to")):
            out = family(GaugeMetricFamily, f"shardrec_supervisor_{name}", doc)
            out.add_metric([rank], float(os.environ.get(env, "0") or 0))
            yield out


def start_metrics_server(port: int, every_rank: bool = False, addr: str = "127.0.0.1") -> Optional[int]:
    """Serves this rank's figures at http://addr:port/metrics: on rank 0 only, or with every_rank on
    each rank at port + its local rank. Returns the port this rank serves on (None: not this rank)."""
    from prometheus_client import CollectorRegistry, start_http_server

    from ..validation import check_int
    from .world import get_world

    check_int("start_metrics_server", "port", port, 1, 65535)
    world = get_world()
    if _STATE.server is not None:
        return _STATE.server[2]
    if not every_rank and world.rank != 0:
        return None
    mine = port + (world.local_rank if every_rank else 0)
    registry = CollectorRegistry()
    registry.register(_Collector(world.rank))
    try:
        server, thread = start_http_server(mine, addr=addr, registry=registry)
    except OSError as e:
        raise OSError(f"the metrics endpoint cannot listen on {addr}:{mine} ({e}); give another port "
                      f"({PORT_ENV}) or stop what uses it") from None
    _STATE.server = (server, thread, mine)
    log.info("metrics at http://%s:%d/metrics", addr, mine)
    return mine


@dataclasses.dataclass(frozen=True)
class _TrainingFigures(batch_events.Observer):
    """Samples trained and the tables' figures, from the key pipeline's training batches (batch_events.py)."""

    def batch_exchanged(self, event: batch_events.BatchExchanged) -> None:
        if event.channel == Channel.TRAIN:
            batch_trained(event.examples, event.tables)


def start_from_environment() -> None:
    """init(): the figures follow the training batches; the endpoint if SHARDREC_METRICS_PORT asks for it."""
    batch_events.register(_TrainingFigures())
    text = os.environ.get(PORT_ENV)
    if not text:
        return
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{PORT_ENV}={text!r} is not allowed; allowed: a port number 1-65535") from None
    start_metrics_server(port, every_rank=os.environ.get(EVERY_RANK_ENV) == "1",
                         addr=os.environ.get(ADDR_ENV, "127.0.0.1"))
