"""Heartbeats for the supervisor (orchestrator/supervisor.py): what a rank tells it through the run
directory, with no network service of its own.

Active only when the supervisor started the rank (it sets SHARDREC_RUN_DIR): each rank then keeps
`<run dir>/heartbeat/rank-<r>.json` up to date, replaced atomically, at most twice a second. A
beat is written when the rank makes progress (the key pipeline finished a batch, or the script
called report()), never by a timer: a rank that hangs stops beating, which is how the supervisor
tells a hung rank from a slow one. The last beat, at exit, says so.
"""
import atexit
import json
import os
import time

RUN_DIR_ENV = "SHARDREC_RUN_DIR"
ATTEMPT_ENV = "SHARDREC_ATTEMPT"
RESUME_ENV = "SHARDREC_RESUME_FROM"
MIN_INTERVAL_S = 0.5

_state = {"fields": {}, "progress": 0, "written": 0.0, "path": None, "rank": None, "tables": {}}


def _path(rank):
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return None
    directory = os.path.join(run_dir, "heartbeat")
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f"rank-{rank}.json")


def start(rank, size):
    """Called by init(): from here on this rank's progress is written for the supervisor."""
    path = _path(rank)
    if path is None or _state["path"] == path:
        return
    _state.update(path=path, rank=rank)
    _state["fields"].update(rank=rank, size=size, pid=os.getpid(), attempt=int(os.environ.get(ATTEMPT_ENV, "0")))
    atexit.register(_last_beat)
    _write(force=True)


def active():
    """Whether a supervisor reads this rank's heartbeats (callers skip their work otherwise)."""
    return _state["path"] is not None


def watch_tables(tables):
    """Tables (name -> object with size()) whose key counts go into every beat; sizes are read only
    when a beat is written, not on every progress."""
    _state["tables"].update(tables)


def progress(**fields):
    """One unit of progress (a batch exchanged, a step reported), with what the rank knows of it."""
    if _state["path"] is None:
        return
    _state["progress"] += 1
    _state["fields"].update(fields)
    _write()


def report(step=None, loss=None, samples_per_s=None, total_steps=None):
    """What a training script tells the supervisor after a step: its global step, loss, speed and
    (if known) the number of steps, for the progress line and the ETA. A no-op without one."""
    fields = {k: v for k, v in (("step", step), ("loss", loss), ("samples_per_s", samples_per_s),
                                ("total_steps", total_steps)) if v is not None}
    progress(**{k: float(v) if k in ("loss", "samples_per_s") else int(v) for k, v in fields.items()})


def resume_checkpoint():
    """The checkpoint the supervisor asks this attempt to resume from (the last committed one when
    the job was restarted), or None. Estimator and MonitoredTrainingSession jobs resume from their
    model directory by themselves; Session-mode scripts restore this path."""
    return os.environ.get(RESUME_ENV) or None


def _write(force=False, **extra):
    now = time.time()
    if not force and now - _state["written"] < MIN_INTERVAL_S:
        return
    _state["written"] = now
    beat = dict(_state["fields"], progress=_state["progress"], time=now, **extra)
    if _state["tables"]:
        beat["tables"] = {name: table.size() for name, table in _state["tables"].items()}
    try:
        import psutil

        beat["rss"] = psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001 - a heartbeat must never fail the step
        pass
    tmp = f"{_state['path']}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(beat, f)
        os.replace(tmp, _state["path"])
    except OSError:
        pass  # a full or vanished run directory must not stop training; the supervisor notices


def _last_beat():
    if _state["path"] is not None:
        _write(force=True, exiting=True)
