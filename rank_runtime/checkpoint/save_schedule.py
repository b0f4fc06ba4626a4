"""When an incremental job saves, and whether a save is a full checkpoint or a delta (init's
save_checkpoint_due_time and save_delta_checkpoints_secs), agreed by every rank.

Every rank holds a part of every table, so every rank must save at the same global step, and all
of them the same kind of save. Clocks do not give that (two ranks pass a given second at different
steps), so rank 0's clock decides and the others follow: each save's plan (full or delta, the
save's id, and the global step of the next save, from rank 0's steps per second since the last
save) goes to every rank in one small collective inside the save, which is collective anyway. Until
the first save the next step is the first one seen. MonitoredTrainingSession's and the Estimator's
CheckpointSaverHook follow the plan (AgreedSaveTimer replaces their timer); a plain Session loop
calls Saver.maybe_save after each step.

The step estimate assumes a steady pace, which a stream does not keep (a backlog trains fast,
then the job waits on the producer): so rank 0's clock also asks for a save in the key exchange's
status round once save_delta_checkpoints_secs have passed since the last save or request
(request_due_save), and every rank saves when training reaches that round's batch, whichever
comes first.

A full save is due once save_checkpoint_due_time seconds have passed since the last full one; a
save is also full when the job has none to build on: the first save of a Saver, the first after a
restore, and the first after a save that failed on any rank.
"""
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from ..process import batch_events, config
from .rank_agreement import AGREE_TIMEOUT_S
from ..formats.channel import Channel
from ..formats.manifest import DELTA, FULL, SaveKind, SaveRef
from ..process.world import get_world


@dataclass
class Chain:
    """The saves a delta of this Saver builds on: the full one, and the last one."""
    base: SaveRef
    previous: SaveRef
    full_time: float  # time.monotonic() of the base's save
    step: int  # the last save's global step
    time: float  # and when it was taken


@dataclass(frozen=True)
class SavePlan:
    kind: SaveKind
    next_step: int  # the global step of the next save (AgreedSaveTimer, Saver.maybe_save)

    @property
    def delta(self) -> bool:
        return self.kind.kind == DELTA


def plan_save(settings: config.IncrementalCheckpoints, chain, step: int, save_delta, must_be_full: bool) -> SavePlan:
    """This save's plan, the same on every rank: rank 0's, except that a delta becomes a full save
    when any rank has nothing to build it on (no chain, or must_be_full: a table emptied since, by a
    restore or a warm start). save_delta: True / False as the caller asks, None as the timers say."""
    now = time.monotonic()
    can_delta = chain is not None and not must_be_full
    if not can_delta:
        delta = False
    elif save_delta is None:
        delta = now - chain.full_time < settings.full_every_s
    else:
        delta = bool(save_delta)
    rate = None
    if chain is not None and step > chain.step and now > chain.time:
        rate = (step - chain.step) / (now - chain.time)
    ahead = max(1, int(rate * settings.delta_every_s)) if rate else 1
    mine = f"{int(delta)} {int(can_delta)} {uuid.uuid4().hex} {step + ahead}"
    texts = [mine]
    if config.get_config().size > 1:
        texts = get_world().gather_texts(mine, f"Saver.save (step {step}): the save's plan", AGREE_TIMEOUT_S)
    delta, _, save_id, next_step = texts[0].split()
    if int(delta) and all(int(text.split()[1]) for text in texts):
        kind = SaveKind(DELTA, save_id, chain.base, chain.previous)
    else:
        kind = SaveKind(FULL, save_id)
    return SavePlan(kind, int(next_step))


def old_links(kinds: list, keep: Callable[[int], bool]) -> int:
    """How many of the oldest saves (`kinds`, oldest first) max_to_keep=`keep` lets go: the oldest
    save goes with the deltas right after it, which build on it, and only when none of them is
    among the `keep` newest. keep 0 or None: every save is kept."""
    if not keep:
        return 0
    gone = 0
    while len(kinds) - gone > keep:
        end = gone + 1
        while end < len(kinds) and kinds[end] == DELTA:
            end += 1
        if end > len(kinds) - keep:
            break
        gone = end
    return gone


@dataclass(eq=False)
class SaveClock(batch_events.Observer):
    """The clock of an incremental job's save requests (rank 0's asks; every rank's is told its
    saves), one from the first incremental Saver to terminate_config_initializer() (save_clock())."""
    since: Optional[float] = None  # time.monotonic() of the last request, or of the first training batch
    saved_at: float = 0.0  # the last save committed
    saved_step: int = -1  # and its global step

    def batch_exchanged(self, event: batch_events.BatchExchanged) -> None:
        if event.channel == Channel.TRAIN:
            self.request_due_save(event.exchange)

    def request_due_save(self, exchange: Any) -> None:
        """After each training batch: rank 0 of an incremental job asks for a save once
        save_delta_checkpoints_secs passed since the last save (or request, or the first batch). Never
        while a request is outstanding (its step not saved yet): the ranks read the requested step
        while their exchanges run ahead of training by different amounts, so with one request at a
        time every rank sees the same one at every step until it is saved."""
        cfg = config.get_config()
        if cfg.incremental is None or cfg.rank != 0:
            return
        now = time.monotonic()
        if self.since is None:
            self.since = now
        elif exchange.save_request_step > self.saved_step:
            return
        elif now - max(self.since, self.saved_at) >= cfg.incremental.delta_every_s:
            exchange.request_save()
            self.since = now

    def saved(self, step: int) -> None:
        self.saved_at, self.saved_step = time.monotonic(), step


def save_clock() -> SaveClock:
    """This init()'s clock: registered as a batch observer by the first incremental Saver, forgotten
    with the others by terminate_config_initializer()."""
    clock = next((o for o in batch_events.observers() if isinstance(o, SaveClock)), None)
    if clock is None:
        clock = SaveClock()
        batch_events.register(clock)
    return clock


def asked_save_due(step: int, last_saved_step: Optional[int]) -> bool:
    """Whether the status round asked for a save that training reached at `step` and that no save
    since took."""
    asked = get_world().exchanges[Channel.TRAIN].save_request_step
    return asked >= 0 and step >= asked and (last_saved_step is None or asked > last_saved_step)


class AgreedSaveTimer:
    """CheckpointSaverHook's timer in an incremental job: it triggers at the step the last save's
    plan named (SavePlan.next_step), which every rank knows, instead of at a time of its own."""

    def __init__(self, hook):
        self._hook = hook
        self._last = None

    def _next_step(self):
        return getattr(self._hook._get_saver(), "next_save_step", None)

    def should_trigger_for_step(self, step: int) -> bool:
        if step == self._last:
            return False
        wanted = self._next_step()
        return wanted is None or step >= wanted or asked_save_due(step, self._last)

    def update_last_triggered_step(self, step: int) -> Tuple[Optional[float], Optional[int]]:
        self._last = step
        return None, None

    def last_triggered_step(self) -> Optional[int]:
        return self._last

    def reset(self) -> None:
        self._last = None
