"""Where a training step's time goes, read from traced Session.runs.

    timeline = StepTimeline(graph)
    for _ in range(n):
        timeline.run(sess, train_op)               # a traced step (every rank traces the same steps)
    report = timeline.report(pipeline_before, pipeline_after, untraced_step_s)   # collective
    print(report.format())

Each traced step's span (first op start to last op end) is cut into parts that add up to it. At
every instant the part is the first of these that holds: an op of the step's own computation runs
(compute); a row all-to-all runs after the last rank reached it (moving data); a row all-to-all
runs before the last rank reached it (waiting for that rank, named by the lookup and direction);
the step waits for the key pipeline's next batch (IteratorGetNext runs alone: the pipeline is on
the critical path); nothing traced runs (executor gaps). So an exchange hidden behind compute
costs nothing, and a wait counts only where the step had nothing else to do. The last rank's
arrival at an exchange comes from every rank's trace of the same step (their clocks are this
host's, or NTP-close across hosts). The key pipeline's thread is reported beside the step: its
own work and its waits for other ranks per batch, from the key exchange's counters.

row_exchange_share is the older single figure: the share of the span with any row all-to-all in
flight, waits included.
"""
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import tensorflow as tf

from ..embedding import native_ops
from ..formats.channel import Channel
from ..process.world import get_world
from . import exchanges

ROW_EXCHANGE_OP = "ShardrecRowAlltoall"
INPUT_OPS = ("IteratorGetNext", "IteratorGetNextSync")
# A dequeue of a ready batch takes microseconds; a step that waited longer than this for its batch
# had the key pipeline on its critical path.
INPUT_WAIT_US = 200


def traced_run_options() -> tf.compat.v1.RunOptions:
    return tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)


def _union_length(intervals):
    total, end = 0, None
    for lo, hi in sorted(intervals):
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def _node_spans(run_metadata):
    """(node name, start us, end us) of every traced node."""
    out = []
    for device in run_metadata.step_stats.dev_stats:
        for node in device.node_stats:
            start = node.all_start_micros
            out.append((node.node_name, start, start + max(node.all_end_rel_micros, 0)))
    if not out:
        raise ValueError("the RunMetadata holds no step stats; run the step with options=traced_run_options()")
    return out


def row_exchange_share(run_metadata: Any, graph: tf.Graph, op_type: str = ROW_EXCHANGE_OP) -> float:
    """Fraction in [0, 1] of the traced step's span spent with an `op_type` op in flight."""
    names = {op.name for op in graph.get_operations() if op.type == op_type}
    spans = _node_spans(run_metadata)
    exchange = [(s, e) for n, s, e in spans if n in names]
    step = max(e for _, _, e in spans) - min(s for _, s, _ in spans)
    return _union_length(exchange) / step if step > 0 else 0.0


@dataclass(frozen=True)
class TracedStep:
    """One traced step of one rank, in microseconds of this host's clock."""

    compute: tuple        # (start, end) of each op of the step's own computation
    inputs: tuple         # (start, end) of each dequeue of the pipeline's batch
    exchanges: dict       # exchange key -> (start, end) of its collective (a row all-to-all, an allreduce)

    @classmethod
    def of(cls, run_metadata, exchange_labels: dict, input_names: set):
        compute, inputs, exchanges = [], [], {}
        for name, start, end in _node_spans(run_metadata):
            if name in exchange_labels:
                exchanges[exchange_labels[name][0]] = (start, end)
            elif name in input_names:
                inputs.append((start, end))
            elif not name.startswith("_"):  # _SOURCE, _SINK, _Recv...: the executor's bookkeeping
                compute.append((start, end))
        return cls(tuple(compute), tuple(inputs), exchanges)


@dataclass
class StepSplit:
    """Microseconds of a step's span by what the rank did; the parts add up to `span`."""

    span: float = 0.0
    compute: float = 0.0
    input_wait: float = 0.0
    idle: float = 0.0
    waiting: dict = field(default_factory=dict)  # exchange label -> us waiting for the last rank
    moving: dict = field(default_factory=dict)   # exchange label -> us moving rows after it arrived

    def add(self, other: "StepSplit"):
        self.span += other.span
        self.compute += other.compute
        self.input_wait += other.input_wait
        self.idle += other.idle
        for mine, theirs in ((self.waiting, other.waiting), (self.moving, other.moving)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v


def split_step(step: TracedStep, arrivals: dict, display: dict | None = None) -> StepSplit:
    """`arrivals`: exchange key -> the latest start over all ranks of that exchange in this step;
    `display`: exchange key -> the label it is reported under (default: the key)."""
    display = display or {}
    # (start, end, priority, what): lower priority numbers win an instant.
    parts = [(s, e, 0, "compute") for s, e in step.compute]
    for key, (s, e) in step.exchanges.items():
        arrived = min(max(arrivals.get(key, s), s), e)
        label = display.get(key, key)
        parts.append((arrived, e, 1, ("moving", label)))
        parts.append((s, arrived, 2, ("waiting", label)))
    parts += [(s, e, 3, "input_wait") for s, e in step.inputs]
    parts = [p for p in parts if p[1] > p[0]]
    spans = [(s, e) for s, e, _, _ in parts] + list(step.inputs)
    out = StepSplit()
    if not spans:
        return out
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    out.span = hi - lo
    cuts = sorted({lo, hi} | {t for s, e, _, _ in parts for t in (s, e)})
    for a, b in zip(cuts, cuts[1:]):
        running = [p for p in parts if p[0] <= a and p[1] >= b]
        if not running:
            out.idle += b - a
            continue
        what = min(running, key=lambda p: (p[2], str(p[3])))[3]
        if what == "compute":
            out.compute += b - a
        elif what == "input_wait":
            out.input_wait += b - a
        else:
            kind, label = what
            bucket = out.moving if kind == "moving" else out.waiting
            bucket[label] = bucket.get(label, 0.0) + (b - a)
    return out


def _exchange_labels(graph: tf.Graph) -> dict:
    """Op name -> (key, label) of each collective op: a row all-to-all by its exchange attribute
    ("<table>/<feature>/<channel>#<n>", "... gradients": the lookup and direction), Horovod's ops
    by name (the same on every rank) under one label."""
    labels = {}
    for op in graph.get_operations():
        if op.type == ROW_EXCHANGE_OP:
            name = op.get_attr("exchange").decode()
            labels[op.name] = (name, name)
        elif op.type.startswith("Horovod"):
            labels[op.name] = (op.name, "Horovod (dense gradients)")
    return labels


@dataclass(frozen=True)
class PipelineShare:
    """The key exchange on the pipeline thread per batch (ms): its wall time outside MPI's waits,
    the CPU time it used (its own work: the wall time also counts the core held by other threads),
    and its waits for other ranks."""

    batches: int
    work_ms: float
    cpu_ms: float
    waiting_ms: float

    @classmethod
    def between(cls, before, after):
        n = max(1, after.batches - before.batches)
        total = after.seconds_total - before.seconds_total
        waiting = after.seconds_in_collectives - before.seconds_in_collectives
        cpu = after.seconds_cpu - before.seconds_cpu
        return cls(after.batches - before.batches, 1e3 * (total - waiting) / n, 1e3 * cpu / n, 1e3 * waiting / n)


@dataclass(frozen=True)
class TimelineReport:
    """One rank's mean traced step (ms) and its pipeline, with the same of every rank (by rank)."""

    rank: int
    steps: int
    step_ms: float                 # untraced steps' mean wall time (Session.run as a user sees it)
    cpu_ms: float                  # the process's CPU time (all its threads) per untraced step
    split_ms: dict                 # part -> ms per traced step ("waiting <exchange>", "moving <exchange>")
    input_bound_steps: int         # traced steps that waited > INPUT_WAIT_US for the pipeline's batch
    pipeline: PipelineShare
    ranks: tuple = ()              # every rank's report as a dict, by rank (filled by StepTimeline.report)

    def as_dict(self) -> dict:
        return {"rank": self.rank, "steps": self.steps, "step_ms": self.step_ms, "cpu_ms": self.cpu_ms,
                "split_ms": self.split_ms,
                "input_bound_steps": self.input_bound_steps,
                "pipeline_ms": {"batches": self.pipeline.batches, "work": self.pipeline.work_ms,
                                "cpu": self.pipeline.cpu_ms, "waiting_for_ranks": self.pipeline.waiting_ms}}

    def format(self) -> str:
        """A table: a row per part of the step, a column per rank."""
        return format_columns([(f"rank {r['rank']}", r) for r in (self.ranks or [self.as_dict()])])


def format_columns(columns: Any) -> str:
    """`columns`: (title, TimelineReport.as_dict()) pairs, printed side by side (1 rank and 2 ranks)."""
    parts = []
    for _, r in columns:
        parts += [k for k in r["split_ms"] if k not in parts]
    order = ("compute", "waiting for a rank", "moving rows", "waiting for the key pipeline", "executor gaps")
    parts.sort(key=lambda k: next((i for i, o in enumerate(order) if k.startswith(o)), len(order)))
    width = max([48] + [len(p) + 4 for p in parts])
    head = "ms per step".ljust(width) + "".join(f"{t:>14}" for t, _ in columns)
    lines = [head, "-" * len(head)]

    def row(label, values):
        lines.append(label.ljust(width) + "".join(f"{v:14.2f}" for v in values))

    row("wall time of an untraced step", [r["step_ms"] for _, r in columns])
    row("CPU time of the rank (all threads) per untraced step", [r["cpu_ms"] for _, r in columns])
    for part in parts:
        row(f"  {part}", [r["split_ms"].get(part, 0.0) for _, r in columns])
    row("key exchange per batch: wall time outside waits", [r["pipeline_ms"]["work"] for _, r in columns])
    row("key exchange per batch: CPU time (its own work)", [r["pipeline_ms"]["cpu"] for _, r in columns])
    row("key exchange per batch: waiting for ranks", [r["pipeline_ms"]["waiting_for_ranks"] for _, r in columns])
    lines.append("traced steps held up by the key pipeline".ljust(width) +
                 "".join(f"{r['input_bound_steps']:>10} of {r['steps']:<2}" for _, r in columns))
    return "\n".join(lines)


class StepTimeline:
    """Traced steps of one rank; report() puts every rank's together (all ranks call it)."""

    def __init__(self, graph: tf.Graph | None = None):
        graph = graph or tf.compat.v1.get_default_graph()
        self._labels = _exchange_labels(graph)
        self._display = dict(self._labels.values())
        self._inputs = {op.name for op in graph.get_operations() if op.type in INPUT_OPS}
        self._steps = []

    def run(self, sess, fetches, **kwargs):
        metadata = tf.compat.v1.RunMetadata()
        out = sess.run(fetches, options=traced_run_options(), run_metadata=metadata, **kwargs)
        self.record(metadata)
        return out

    def record(self, run_metadata: Any) -> None:
        self._steps.append(TracedStep.of(run_metadata, self._labels, self._inputs))

    def report(self, pipeline_before, pipeline_after, step_s: float, cpu_s: float = 0.0) -> TimelineReport:
        """`pipeline_before/after`: the training channel's exchange counters around the timed steps;
        `step_s`, `cpu_s`: their mean wall time and the process's CPU time per step
        (time.process_time()). Collective with more than one rank."""
        from ..process.world import get_world

        world = get_world()
        starts = [{k: s for k, (s, _) in step.exchanges.items()} for step in self._steps]
        every = [json.loads(t) for t in world.gather_texts(json.dumps(starts), "the step timeline's arrivals")] \
            if world.size > 1 else [starts]
        total, bound = StepSplit(), 0
        for i, step in enumerate(self._steps):
            arrivals = {}
            for rank_starts in every:
                for label, s in (rank_starts[i] if i < len(rank_starts) else {}).items():
                    arrivals[label] = max(arrivals.get(label, s), s)
            total.add(split_step(step, arrivals, self._display))
            bound += any(e - s > INPUT_WAIT_US for s, e in step.inputs)
        n = max(1, len(self._steps))
        split = {"compute": total.compute / n / 1e3}
        for label in sorted(set(total.waiting) | set(total.moving)):
            split[f"waiting for a rank: {label}"] = total.waiting.get(label, 0.0) / n / 1e3
            split[f"moving rows: {label}"] = total.moving.get(label, 0.0) / n / 1e3
        split["waiting for the key pipeline"] = total.input_wait / n / 1e3
        split["executor gaps"] = total.idle / n / 1e3
        split["traced span"] = total.span / n / 1e3
        mine = TimelineReport(world.rank, len(self._steps), 1e3 * step_s, 1e3 * cpu_s, split, bound,
                              PipelineShare.between(pipeline_before, pipeline_after))
        ranks = [json.loads(t) for t in world.gather_texts(json.dumps(mine.as_dict()), "the step timeline")] \
            if world.size > 1 else [mine.as_dict()]
        return dataclasses.replace(mine, ranks=tuple(ranks))


def wire_bytes(channel: Channel = Channel.TRAIN) -> int:
    """Bytes this rank has sent other ranks on `channel` so far: its key rounds (keys, their counts,
    bucket sizes, pooled features' id words; the key exchange's own counters) and the row exchanges
    of this graph's lookups (rows and gradients; the op library's counters). Its own blocks are
    copies and not counted. The difference over n steps, divided by n, is a step's traffic."""
    counters = get_world().exchanges[channel].counters()
    total = counters.key_bytes_sent + counters.pool_bytes_sent
    for name in exchanges.of_graph().names(channel):
        total += native_ops.exchange_bytes_sent(name.rows) + native_ops.exchange_bytes_sent(name.gradients)
    return total
