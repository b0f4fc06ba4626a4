"""What a rank tells the supervisor, and how: the environment the supervisor sets for its ranks,
the signals it sends them, and one Heartbeat per line of the rank's standard error, after MARK, as JSON. The rank side
(heartbeat.py) writes it and the supervisor (orchestrator/supervisor.py) reads it with this one
type. Imports nothing of TensorFlow or MPI: the supervisor never does.
"""
import json
import signal
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, Optional

RUN_DIR_ENV = "SHARDREC_RUN_DIR"
ATTEMPT_ENV = "SHARDREC_ATTEMPT"
RESUME_ENV = "SHARDREC_RESUME_FROM"
INTERVAL_ENV = "SHARDREC_HEARTBEAT_INTERVAL_S"
# How many times the supervisor restarted the job after a failure, and resized it, before this
# attempt (the metrics endpoint shows them).
RESTARTS_ENV = "SHARDREC_RESTARTS"
RESIZES_ENV = "SHARDREC_RESIZES"
MARK = "SHARDREC-HEARTBEAT "
# A rank writes every thread's Python stack to its standard error and goes on (init() registers it;
# the supervisor and the tests' helpers send it to a rank before they kill it as hung).
STACKS_SIGNAL = signal.SIGUSR1
# An elastic job grows: every rank saves at the end of its current step and stops (sent to mpiexec,
# which forwards it to every rank on every host; resize.py).
RESIZE_SIGNAL = signal.SIGUSR2


@dataclass
class Heartbeat:
    # Who: set once, when the rank starts beating.
    rank: int = 0
    size: int = 1
    pid: int = 0
    host: str = ""
    host_memory: int = 0  # bytes of the rank's host (the supervisor's memory warnings compare with it)
    attempt: int = 0
    # Progress: a counter that moves on every batch or report(); a hung rank's stops.
    progress: int = 0
    time: float = 0.0
    # What the training script reports (report()).
    step: Optional[int] = None
    loss: Optional[float] = None
    samples_per_s: Optional[float] = None
    total_steps: Optional[int] = None
    # Batches the key pipeline exchanged in the current pass, per channel.
    train_batches: Optional[int] = None
    eval_batches: Optional[int] = None
    # Per table: keys held; admission counters; SSD tier counters (their as_dict()).
    tables: Dict[str, int] = field(default_factory=dict)
    admission: Dict[str, dict] = field(default_factory=dict)
    tiers: Dict[str, dict] = field(default_factory=dict)
    rss: int = 0
    exiting: bool = False  # the rank's last beat, at exit
    resize_stop: bool = False  # the rank ended its training input because the supervisor asked (resize.py)
    # The rank's stream has no new data and it waits for some (stream/): the job makes no progress
    # by design, and the ranks in the key exchange wait for it (silence still counts).
    waiting_for_data: bool = False

    def step_or_batches(self) -> Optional[int]:
        """The training step the script reported, else the training batches exchanged."""
        return self.step if self.step is not None else self.train_batches

    def to_dict(self) -> dict:
        """The fields that have a value."""
        return {k: v for k, v in asdict(self).items() if v is not None and v != {}}

    def line(self) -> bytes:
        """The beat as the one line the rank writes."""
        return (MARK + json.dumps(self.to_dict(), separators=(",", ":")) + "\n").encode()

    @classmethod
    def parse(cls, text: str) -> Optional["Heartbeat"]:
        """The beat in `text` (the JSON after MARK), or None when it was cut short by a dying rank."""
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
