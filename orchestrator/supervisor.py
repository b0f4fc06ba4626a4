"""The supervisor: runs one MPI job (`mpiexec ... COMMAND`) as a series of attempts, watches every
rank, and restarts the whole job from the last committed checkpoint when a rank dies or hangs.

One attempt:
- `mpiexec --output tag` starts the ranks in a process session of its own; its tagged output is
  split into `<run dir>/attempt-<k>/rank-<r>.log` (rank 0's lines also go to the terminal);
- each rank's heartbeats (rank_runtime/process/heartbeat.py) arrive in that output, so no shared filesystem
  is needed; the last of each is kept in `<run dir>/attempt-<k>/heartbeat/rank-<r>.json`. A rank
  silent for `hang_timeout` seconds is frozen, dead or cut off (a whole host silent while another
  host still beats is a lost host); a rank that beats but makes no progress for as long is hung; a
  rank near the host's memory is reported before the kernel kills it;
- the attempt ends well when mpiexec exits 0 *and* every rank that beat has said goodbye (Open MPI
  can exit 0 after losing a remote host), badly when mpiexec exits non-zero or a rank hangs. Then
  every process of the attempt is killed and checked gone with psutil before anything else starts.

An elastic job (JobSpec.elastic, elastic.py) runs each attempt on the hosts its discovery script
lists now: a lost host cools down and the job goes on with the ranks left; when more slots are
usable, the ranks are asked to save at the end of their step and stop (SIGUSR2 through mpiexec),
and the next attempt starts on them all, from that checkpoint.

Never imports TensorFlow: it starts at once and outlives any rank.
"""
import os
import signal
import sys
import time
from typing import List, Optional, Tuple

from . import checkpoints, run_summary
from .attempt import Attempt, log
from .elastic import HostWatch
from .job_spec import JobSpec
from .mpiexec_output import LAUNCHER, without_mpi_banners
from .run_summary import AttemptEnd, AttemptSummary, RankSummary, RunSummary, summed, summed_counters

MAX_RESTART_DELAY_S = 300.0


class _Interrupt:
    """SIGINT / SIGTERM end the job cleanly: the watch loop sees the flag and stops every rank."""

    def __init__(self):
        self.signal = None
        self.count = 0

    def __enter__(self):
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        self.signal = signum
        self.count += 1

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def latest_checkpoint(directory: Optional[str]) -> Tuple[Optional[str], Optional[int]]:
    """(dense prefix, step) of the newest complete checkpoint in `directory`, or (None, None)."""
    if not directory or not os.path.isdir(directory):
        return None, None
    complete = [c for c in checkpoints.find_checkpoints(directory) if c.ok]
    if not complete:
        return None, None
    return complete[-1].dense_prefix, complete[-1].step


def why_none(directory: str) -> str:
    """Why the checkpoints of `directory` are not complete (the newest's problems), when it has any."""
    try:
        found = checkpoints.find_checkpoints(directory) if os.path.isdir(directory) else []
    except OSError as e:  # a rank of the ended attempt still removing an old save, say
        return f"; reading it failed: {e}"
    if not found:
        return ""
    complete = [c.name for c in found if c.ok]
    if complete:  # complete a moment after the first look: something still wrote there
        return f"; a second look finds {complete[-1]} complete"
    newest = found[-1]
    problems = newest.problems + [p for shard in newest.shards.values() for p in shard.problems]
    return f"; {len(found)} incomplete, the newest {newest.name}: " + "; ".join(problems)[:500]


class Supervisor:
    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.attempts: List[Attempt] = []

    def run(self) -> int:
        """Runs the job; returns the exit status: 0 done, 1 failed after the allowed restarts (or,
        elastic, fewer than --min-np slots for --elastic-timeout), 130 interrupted."""
        os.makedirs(self.spec.run_dir, exist_ok=True)
        log(f"run directory {self.spec.run_dir}")
        started = time.monotonic()
        self.watch = (HostWatch(self.spec.elastic, log, os.path.join(self.spec.run_dir, "hosts.log"))
                      if self.spec.elastic else None)
        with _Interrupt() as interrupt:
            if self.watch:
                self.watch.start()  # wait_for_placement runs the script at once
            try:
                return self._attempts(started, interrupt)
            finally:
                if self.watch:
                    self.watch.stop()

    def _attempts(self, started: float, interrupt: "_Interrupt") -> int:
        """Attempt after attempt, until one decides the job's exit status."""
        resume, failures, resizes, placement = None, 0, 0, None
        while True:
            number = len(self.attempts)
            if self.watch:
                before, placement = placement, self.watch.wait_for_placement(interrupt, first=number == 0)
                if placement is None:
                    return self._too_few_hosts(started, before, interrupt, first=number == 0)
                if before is None or placement != before:
                    log(f"attempt {number}: {placement.np} rank(s) on {placement.describe()}")
            attempt = Attempt(self.spec, number, resume, interrupt, placement,
                              on_tick=self._maybe_grow if self.watch else None,
                              usable_hosts=self._listed_hosts if self.watch else None, history=(failures, resizes))
            self.attempts.append(attempt)
            end = attempt.run()
            last, step = latest_checkpoint(self.spec.checkpoint_dir)
            where = f"; the last complete checkpoint is {last} (step {step})" if last else ""
            if end.interrupted:
                log(f"stopped: {end.reason}; every rank is stopped{where}")
                return 130
            if attempt.stopping is not None:
                return self._stopped_on_request(attempt, end, started, where)
            if end.ok and not attempt.stopped_for_resize():
                self.write_summary(started, end)
                return 0
            self._steps_lost(attempt, step)
            if end.ok:
                resizes += 1
                self._say_resized(attempt, last, step)
            else:
                status = self._after_failure(attempt, end, started, where, failures, resizes, last, step, interrupt)
                if status is not None:
                    return status
                failures += 1
            resume = last

    def _say_resized(self, attempt, last, step) -> None:
        reached = attempt.last_step()
        log(f"attempt {attempt.number} " + ("saved and stopped" if reached == step else
                                             "stopped without a checkpoint of its last step") +
            f" at step {reached} to grow ({attempt.resizing}); "
            + (f"resuming from {last} (step {step})" if last else "starting again from step 0 (no complete checkpoint)")
            + ("" if reached == step else "; a script that saves when its loop ends loses no step"))

    def _after_failure(self, attempt, end, started, where, failures, resizes, last, step, interrupt):
        """After a failed attempt: the exit status when the job stops here (1: no restart left, 130:
        interrupted while waiting), else None once the wait before the restart is over."""
        log(f"attempt {attempt.number} failed: {end.reason}")
        self._print_tail(attempt, end.rank)
        if self.watch:
            self._cool_down(end)
        if failures == self.spec.max_restarts:
            log(f"giving up after {attempt.number + 1} attempt(s) (--max-restarts {self.spec.max_restarts}){where}")
            self.write_summary(started, end)
            return 1
        # Doubling waits: a host that is down, or a cause that persists, is not retried in a burst
        # that spends every restart within a second.
        delay = min(MAX_RESTART_DELAY_S, self.spec.restart_delay * 2 ** failures)
        log(f"restarting the job in {delay:.0f} s (attempt {attempt.number + 1} of "
            f"{self.spec.max_restarts + 1 + resizes}) from "
            + (f"{last} (step {step})" if last else "the start (no complete checkpoint"
               + (f" in {self.spec.checkpoint_dir}{why_none(self.spec.checkpoint_dir)})"
                  if self.spec.checkpoint_dir else ", no --checkpoint-dir)")))
        if not self._wait(delay, interrupt):
            log(f"stopped: interrupted by signal {interrupt.signal} before the restart{where}")
            return 130
        return None

    def _stopped_on_request(self, attempt: Attempt, end: AttemptEnd, started: float, where: str) -> int:
        """The exit status of a job whose ranks were asked to save and stop (SIGTERM / SIGINT)."""
        if not end.ok:
            log(f"stopped: asked to by signal {attempt.interrupt.signal}, and the attempt failed meanwhile: "
                f"{end.reason}{where}")
            return 130
        log(f"stopped: asked to by signal {attempt.interrupt.signal}; every rank saved and exited at step "
            f"{attempt.last_step()}{where}")
        self.write_summary(started, end)
        return 0

    def _steps_lost(self, attempt, resumed_step):
        """Says how many steps the next attempt trains again: those since the checkpoint it resumes from."""
        lost = attempt.count_steps_lost(resumed_step)
        reached = attempt.ended.reached_step
        if lost:
            log(f"{lost} step(s) lost: the ranks had reached step {reached}, the next attempt resumes from step "
                f"{resumed_step or 0}")

    def _cool_down(self, end: AttemptEnd) -> None:
        """A lost host, or one whose ranks failed in two attempts in a row, stays out of the next
        attempts for its cooldown; a rank that failed once restarts on the same hosts."""
        assert self.watch is not None
        attempt = self.attempts[-1]
        # The name the discovery script gave, which the placement uses (a rank's own hostname may differ).
        host = attempt.placement.host_of_rank(end.rank) if end.rank is not None else None
        host = host or end.host
        if host is None:
            return
        earlier = self.attempts[-2].ended if len(self.attempts) > 1 else None
        again = earlier is not None and earlier.host == host
        attempt.blame_host(host)
        if end.host_lost or again:
            seconds = self.watch.cooldowns.failed(host)
            log(f"host {host} stays out of new attempts for {seconds:.0f} s (--blacklist-cooldown-range; "
                f"{self.watch.cooldowns.failures[host]} failure(s))")

    def _listed_hosts(self):
        return {h.name for h in (self.watch.refresh() or [])}

    def _maybe_grow(self, attempt):
        """While an elastic attempt runs: when more slots are usable (up to --max-np), asks its ranks
        to save and stop, so that the next attempt starts on them all."""
        if not attempt.all_ranks_beat():
            return
        bigger = self.watch.can_grow(attempt.np)
        if bigger is not None:
            why = f"{bigger.np} slot(s) usable now: {bigger.describe()}"
            log(f"growing from {attempt.np} to {bigger.np} rank(s) ({why}): asking every rank to save at the end of "
                "its current step and stop")
            attempt.request_resize(why)

    def _too_few_hosts(self, started, before, interrupt, first):
        if interrupt.signal is not None:
            log(f"stopped: interrupted by signal {interrupt.signal} while waiting for hosts")
            return 130
        usable = {h.name for h in self.watch.placement().hosts}
        lost = sorted(h.name for h in before.hosts if h.name not in usable) if before else []
        _, option = self.watch.needed(first)
        reason = (f"fewer than {option} slot(s) usable for {self.spec.elastic.timeout:.0f} s "
                  f"(--elastic-timeout)" + (f"; hosts lost: {', '.join(lost)}" if lost else "")
                  + f"; usable now: {self.watch.placement().describe() or 'none'}")
        log(f"giving up: {reason}")
        self.write_summary(started, AttemptEnd(False, reason))
        return 1

    @staticmethod
    def _wait(seconds, interrupt):
        """Sleeps `seconds`; False if SIGINT / SIGTERM came meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if interrupt.signal is not None:
                return False
            time.sleep(0.1)
        return interrupt.signal is None

    @staticmethod
    def _print_tail(attempt, rank):
        lines = attempt.tails.get(rank) if rank is not None else attempt.tails.get(LAUNCHER)
        if not lines:
            return
        name = f"rank {rank}" if rank is not None else "mpiexec"
        log(f"last lines of {name} ({os.path.join(attempt.dir, f'rank-{rank}.log' if rank is not None else 'mpiexec.log')}):")
        # mpiexec's own boxed notice is its message; a rank's last words say more than the boxes around them.
        for line in (list(lines)[-20:] if rank is None else without_mpi_banners(list(lines))[-12:]):
            print(f"    {line}", file=sys.stderr)

    def write_summary(self, started: float, end: AttemptEnd) -> None:
        """summary.json in the run directory: how the job ended (`end`), from time.monotonic() `started`."""
        last_beats = self.attempts[-1].beats if self.attempts else {}
        summary = RunSummary(
            ok=end.ok, attempts=len(self.attempts), restarts=max(0, len(self.attempts) - 1),
            seconds=round(time.monotonic() - started, 1), reason=end.reason, failed_ranks=end.ranks,
            lost_host=end.host if end.host_lost else None,
            ranks={r: RankSummary(b.step, b.train_batches, b.loss, b.samples_per_s, b.tables or None,
                                  max(a.peak_rss.get(r, 0) for a in self.attempts))
                   for r, b in sorted(last_beats.items())},
            attempt_list=[AttemptSummary(a.number, a.np, a.placement.mpiexec_hosts() if a.placement else self.spec.hosts,
                                         a.resume_from, a.ended)
                          for a in self.attempts],
            tables=summed([b.tables for b in last_beats.values()]),
            admission=summed_counters([b.admission for b in last_beats.values()]),
            tiers=summed_counters([b.tiers for b in last_beats.values()]))
        if self.spec.checkpoint_dir and os.path.isdir(self.spec.checkpoint_dir):
            found = checkpoints.find_checkpoints(self.spec.checkpoint_dir, verify=False)
            summary.checkpoints = [c.name for c in found if c.ok]
        path = run_summary.write(self.spec.run_dir, summary)
        peak = ", ".join(f"rank {r}: {s.peak_rss / 2**20:.0f} MiB" for r, s in summary.ranks.items())
        tables = ", ".join(f"{name} {size} keys" for name, size in sorted(summary.tables.items()))
        tables += "".join(f"; {name}: " + ", ".join(f"{k} {v}" for k, v in c.items())
                          for name, c in (summary.admission or {}).items())
        log(f"{'done' if end.ok else 'failed'}: {summary.attempts} attempt(s), {summary.restarts} restart(s), "
            f"{summary.seconds} s; peak memory {peak or 'n/a'}; tables {tables or 'n/a'}; summary in {path}")
