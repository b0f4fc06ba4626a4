"""`<run dir>/summary.json`, what a supervised run leaves for its user and for scripts: how it ended,
each attempt, and each rank's last word. Written and read through these types (write(), read()), so
that its keys are named once."""
import collections
import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Dict, List, Optional

FILE = "summary.json"


@dataclass
class RankSummary:
    """A rank's last heartbeat of the last attempt, and its peak memory over every attempt."""
    step: Optional[int]
    train_batches: Optional[int]
    loss: Optional[float]
    samples_per_s: Optional[float]
    tables: Optional[Dict[str, int]]   # keys held, per table
    peak_rss: int


@dataclass
class AttemptEnd:
    """How an attempt ended: what Attempt.run() returns, what the supervisor decides on, and what
    summary.json's attempt_list says of it (its fields beside the attempt's own)."""
    ok: bool
    reason: str = ""
    rank: Optional[int] = None            # the rank blamed for a failure
    exit_code: Optional[int] = None       # mpiexec's
    interrupted: bool = False             # by SIGINT / SIGTERM to the supervisor
    host: Optional[str] = None            # the failed rank's host, or the host lost
    host_lost: bool = False               # the whole host went (silent, or its Open MPI daemon lost)
    ranks: Optional[List[int]] = None     # every rank blamed (a lost host's ranks)
    reached_step: Optional[int] = None    # the last step its ranks reported
    steps_lost: Optional[int] = None      # steps the next attempt trains again (since the checkpoint it resumes)


@dataclass
class AttemptSummary:
    """One attempt: its ranks and hosts, the checkpoint it restored, and how it ended (None while it
    had not)."""
    attempt: int
    np: int
    hosts: Optional[str]
    resumed_from: Optional[str]
    end: Optional[AttemptEnd] = None

    def to_json(self) -> dict:
        out = {"attempt": self.attempt, "np": self.np, "hosts": self.hosts, "resumed_from": self.resumed_from}
        return {**out, **asdict(self.end)} if self.end is not None else out

    @classmethod
    def from_json(cls, raw: dict) -> "AttemptSummary":
        ends = {f.name for f in fields(AttemptEnd)}
        end = AttemptEnd(**{k: v for k, v in raw.items() if k in ends}) if "ok" in raw else None
        return cls(raw["attempt"], raw["np"], raw["hosts"], raw["resumed_from"], end)


@dataclass
class RunSummary:
    ok: bool
    attempts: int
    restarts: int
    seconds: float
    reason: str
    failed_ranks: Optional[List[int]]
    lost_host: Optional[str]
    ranks: Dict[int, RankSummary]
    attempt_list: List[AttemptSummary]
    tables: Dict[str, int]                          # keys held by all ranks together, per table
    # Admission and eviction counters, and those of the storage tiers, summed over the ranks, per
    # table; absent when no table has them.
    admission: Optional[Dict[str, Dict[str, int]]] = None
    tiers: Optional[Dict[str, Dict[str, int]]] = None
    checkpoints: Optional[List[str]] = None         # the complete checkpoints of --checkpoint-dir

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["ranks"] = {r: asdict(s) for r, s in sorted(self.ranks.items())}
        out["attempt_list"] = [a.to_json() for a in self.attempt_list]
        return {k: v for k, v in out.items() if not (k in _OPTIONAL and v is None)}


_OPTIONAL = {"admission", "tiers", "checkpoints"}


def summed(per_rank: List[Dict[str, int]]) -> Dict[str, int]:
    """{name: value summed over the ranks}. Counter.update, not Counter's +, which drops a name
    whose sum is 0 (a table that holds no key yet is still listed)."""
    total: collections.Counter = collections.Counter()
    for values in per_rank:
        total.update(values)
    return dict(total)


def summed_counters(per_rank: List[Dict[str, Dict[str, int]]]) -> Optional[Dict[str, Dict[str, int]]]:
    """Counters of each table summed over the ranks ({table: {counter: value}}), None when none has any."""
    names = sorted({table for tables in per_rank for table in tables})
    return {table: summed([tables.get(table, {}) for tables in per_rank]) for table in names} or None


def write_json(path: str, value: object, indent: Optional[int] = None) -> None:
    """`value` as JSON at `path`, whole or not at all: a reader that finds the file (a test, a user's
    tool polling the run directory) never reads half of it."""
    with open(path + ".tmp", "w") as f:
        json.dump(value, f, indent=indent)
    os.replace(path + ".tmp", path)


def write(run_dir: str, summary: RunSummary) -> str:
    path = os.path.join(run_dir, FILE)
    write_json(path, summary.to_json(), indent=1)
    return path


def read(run_dir: str) -> RunSummary:
    """The summary of the run in `run_dir`, checked against these types (a missing key is an error
    naming it; keys a later shardrec added are left out)."""
    path = os.path.join(run_dir, FILE)
    with open(path) as f:
        raw = json.load(f)
    try:
        ranks = {int(r): RankSummary(**s) for r, s in raw.pop("ranks").items()}
        attempts = [AttemptSummary.from_json(a) for a in raw.pop("attempt_list")]
        known = {f.name for f in fields(RunSummary)}
        return RunSummary(ranks=ranks, attempt_list=attempts, **{k: v for k, v in raw.items() if k in known})
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a run summary this shardrec reads ({e})") from None
