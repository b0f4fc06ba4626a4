"""Every piece of process-wide state of a rank, in one place (as Horovod keeps its global state in
one struct): what init() was given, the world and its communicators, what was patched and loaded
into TensorFlow, what the heartbeat and the logs carry. Everything else in `rank_runtime/` is
per graph (config.GraphState) or per object.

This module imports nothing of shardrec when it runs (its types are named for readers and type
checkers only), so any module may read it; each field says which module owns (writes) it. Tests
and terminate_config_initializer() reset what they own. tests/test_imports.py fails on a
module-level variable that holds state anywhere else.
"""
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set

if TYPE_CHECKING:
    from ..embedding.table import EmbeddingTable
    from ..formats.heartbeat_format import Heartbeat
    from ..serving.export import ServingExport
    from ..stream.partitioned import PartitionedStream
    from .config import RuntimeConfig
    from .metrics import SaveFigures
    from .world import World


@dataclass
class HeartbeatState:
    """heartbeat.py's: the next beat (a heartbeat_format.Heartbeat, set by start()), when the last
    was written, the tables watched."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    beat: "Optional[Heartbeat]" = None
    written: float = 0.0
    exited: bool = False  # the last beat (exiting) is written: no beat may follow it
    fd: Optional[int] = None
    tables: "Dict[str, EmbeddingTable]" = field(default_factory=dict)
    # What the last progress beat read of the tables (the ticker repeats it).
    sizes: Dict[str, int] = field(default_factory=dict)
    admission: Dict[str, dict] = field(default_factory=dict)
    tiers: Dict[str, dict] = field(default_factory=dict)


@dataclass
class ResizeState:
    """resize.py's: the supervisor asked for a stop (set by the signal handler, which may only set a
    field), and the batch after which this rank's input stopped for it (said once)."""
    asked: bool = False
    stopped_after: Optional[int] = None
    wakeup: Optional[int] = None  # the read end of the signals' pipe (resize.py)
    on_sigterm: bool = False  # SIGTERM asks for the stop too (a job that trains from a stream)
    terms: int = 0  # SIGTERMs arrived: the second ends the process


@dataclass
class MetricsState:
    """metrics.py's: samples trained, the tables' figures as last read (name -> rows, admitted,
    evicted), the last save (a metrics.SaveFigures); the endpoint's (server, thread, port)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    samples: int = 0
    rate: float = 0.0  # samples/s over the last refresh interval
    rate_from: tuple = (0.0, 0)  # (monotonic time, samples) the rate is measured from
    tables: Dict[str, dict] = field(default_factory=dict)
    last_save: "Optional[SaveFigures]" = None
    server: Optional[tuple] = None
    progress_thread: Optional[threading.Thread] = None
    progress_tables: Dict[str, dict] = field(default_factory=dict)  # as at the last progress line


@dataclass
class SaveTimerState:
    """save_schedule.py's: rank 0's clock for save requests (time.monotonic())."""
    since: Optional[float] = None  # the last request, or the first training batch
    saved_at: float = 0.0  # the last save committed
    saved_step: int = -1  # and its global step


@dataclass
class ProcessState:
    # config.py / lifecycle.py: the RuntimeConfig of the running init(), None before and after.
    config: "Optional[RuntimeConfig]" = None
    terminate_registered: bool = False
    # world.py: the World (MPI, Horovod, the communicators), made by the first init().
    world: "Optional[World]" = None
    # tf_patches.py: TensorFlow's classes and functions were patched (once per process), and
    # TensorFlow's own get_checkpoint_state that saver.get_checkpoint_state falls back on.
    tensorflow_patched: bool = False
    tf_get_checkpoint_state: Optional[Callable] = None
    # native_ops.py: the op libraries loaded, by path.
    op_libraries: Dict[str, object] = field(default_factory=dict)
    # logs.py: what every log line starts with, and the warnings already given once.
    rank_text: str = "rank 0/1"
    warned: Set[str] = field(default_factory=set)
    # exit_hooks.py: the statuses sys.exit was called with; whether its hooks are installed.
    exit_statuses: List[object] = field(default_factory=list)
    exit_hooks_installed: bool = False
    heartbeat: HeartbeatState = field(default_factory=HeartbeatState)
    resize: ResizeState = field(default_factory=ResizeState)
    # serving/export.py: the export in progress in this process (create_table and sparse_lookup ask).
    serving_export: "Optional[ServingExport]" = None
    # stream/: the stream this process trains from (its dataset() sets it); the key
    # pipeline reports its training batches to it, the Saver saves and restores its positions.
    stream: "Optional[PartitionedStream]" = None
    metrics: MetricsState = field(default_factory=MetricsState)
    # batch_events.py: the observers of the key pipeline's batches (registered from init() on).
    batch_observers: List[object] = field(default_factory=list)
    save_timer: SaveTimerState = field(default_factory=SaveTimerState)


STATE = ProcessState()
