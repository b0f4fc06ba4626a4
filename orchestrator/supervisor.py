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
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import psutil

from . import checkpoints, job_kill
from .elastic import ElasticSpec, HostWatch
from .failure_cause import TAGGED, Evidence, judge, lost_daemon_host, silent_host
from shardrec.rank_runtime.formats import heartbeat_format as beats
from shardrec.rank_runtime.formats.heartbeat_format import Heartbeat

TAIL_LINES = 60
MAX_RESTART_DELAY_S = 300.0
FINISH_GRACE_S = 60.0  # how long ranks may take to finish once one rank has exited


@dataclass
class JobSpec:
    command: list                       # what every rank runs, an argument list
    np: int
    run_dir: str
    max_restarts: int = 3
    hang_timeout: float = 300.0         # seconds without progress before a rank counts as hung
    checkpoint_dir: str = None          # where the job saves; restarts resume from its last complete checkpoint
    hosts: str = None                   # mpiexec -H
    hostfile: str = None                # mpiexec --hostfile
    forward_env: list = field(default_factory=list)  # mpiexec -x, for remote hosts
    mpiexec_args: list = field(default_factory=list)
    memory_share: float = 0.9           # warn when a rank's RSS passes this share of the host's memory
    restart_delay: float = 5.0          # seconds before the first restart, doubled for each one after
    echo: bool = True                   # rank 0's output on this terminal
    progress_every: float = 10.0        # seconds between progress lines when stdout is not a terminal
    elastic: ElasticSpec = None         # --host-discovery-script and friends: the job shrinks and grows


@dataclass
class Outcome:
    ok: bool
    reason: str = ""
    rank: int = None
    exit_code: int = None
    interrupted: bool = False
    host: str = None          # the failed rank's host, or the host lost
    host_lost: bool = False   # the whole host went (silent, or its Open MPI daemon lost)
    ranks: list = None        # every rank blamed (a lost host's ranks); else [rank] or None


def log(text):
    print(f"[shardrec-run {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


class _Interrupt:
    """SIGINT / SIGTERM end the job cleanly: the watch loop sees the flag and stops every rank."""

    def __init__(self):
        self.signal = None

    def __enter__(self):
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        self.signal = signum

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


@dataclass
class AttemptEnd:
    """How an attempt ended, for summary.json's attempt_list."""
    ok: bool
    reason: str
    reached_step: int = None   # the last step its ranks reported
    steps_lost: int = None     # steps the next attempt trains again (since the checkpoint it resumes)
    host: str = None           # the host blamed for a failure
    host_lost: bool = False    # the whole host was lost, with every rank there
    ranks: list = None         # the ranks blamed for a failure


class Attempt:
    def __init__(self, spec, number, resume_from, interrupt, placement=None, on_tick=None, usable_hosts=None):
        """placement: where the ranks go (an elastic job's hosts.Placement), else spec's -np and
        hosts; on_tick(attempt): called on every turn of the watch loop (an elastic job's growth);
        usable_hosts(): the host names an elastic job's discovery lists now."""
        self.spec, self.number, self.resume_from, self.interrupt = spec, number, resume_from, interrupt
        self.placement, self.on_tick, self.usable_hosts = placement, on_tick, usable_hosts
        self.np = placement.np if placement else spec.np
        self.resizing = None     # why the supervisor asked the ranks to save and stop, once it did
        self.ended = None        # an AttemptEnd once it has
        self.dir = os.path.join(spec.run_dir, f"attempt-{number}")
        self.heartbeat_dir = os.path.join(self.dir, "heartbeat")
        os.makedirs(self.heartbeat_dir, exist_ok=True)
        self.tails = collections.defaultdict(lambda: collections.deque(maxlen=TAIL_LINES))
        self._lock = threading.Lock()  # the output reader records beats, the watch loop judges them
        self.beats = {}          # rank -> last heartbeat
        self.moved = {}          # rank -> supervisor time its progress last changed
        self.heard = {}          # rank -> supervisor time its last beat arrived
        self.peak_rss = collections.defaultdict(int)
        self._warned_memory = set()
        # Ticks often enough that a silent rank stands out well within the hang timeout.
        self.tick = min(5.0, max(0.2, spec.hang_timeout / 6))

    def command(self):
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
        if mpiexec is None:
            raise FileNotFoundError("mpiexec not found next to this Python or on PATH (scripts/bootstrap.sh installs it)")
        cmd = [mpiexec, "--output", "tag", "-np", str(self.np)]
        if self.placement:
            cmd += ["-H", self.placement.mpiexec_hosts()]
        elif self.spec.hostfile:
            cmd += ["--hostfile", self.spec.hostfile]
        if self.spec.hosts and not self.placement:
            cmd += ["-H", self.spec.hosts]
        if not self.spec.hostfile and not self.spec.hosts and not self.placement:
            cmd.append("--oversubscribe")  # one host: as many ranks as asked, whatever its cores
        forwarded = [beats.RUN_DIR_ENV, beats.ATTEMPT_ENV, beats.INTERVAL_ENV]
        if self.resume_from:
            forwarded.append(beats.RESUME_ENV)
        for name in forwarded + list(self.spec.forward_env):
            cmd += ["-x", name]
        return cmd + list(self.spec.mpiexec_args) + list(self.spec.command)

    def run(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{beats.RUN_DIR_ENV: self.dir,
                                                         beats.ATTEMPT_ENV: str(self.number),
                                                         beats.INTERVAL_ENV: str(self.tick)})
        if self.resume_from:
            env[beats.RESUME_ENV] = self.resume_from
        # MPI's waits yield their core to the rank's other threads (rank_runtime/process/host_defaults.py says
        # why), on every host: mpiexec passes OMPI_MCA_* variables to all ranks.
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
        # Open MPI's session files in a directory of this attempt's own, removed when it ends: a killed
        # attempt leaves its rendezvous files behind, and a later mpiexec that gets the same PID (they
        # are reused; 32768 of them here) cannot start ("The PMIx server's listener thread failed").
        self.tmp = tempfile.mkdtemp(prefix="shardrec-mpi-")
        env["TMPDIR"] = self.tmp
        cmd = self.command()
        with open(os.path.join(self.dir, "command.json"), "w") as f:
            json.dump({"command": cmd, "resume_from": self.resume_from, "np": self.np,
                       "hosts": self.placement.mpiexec_hosts() if self.placement else self.spec.hosts}, f, indent=1)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True, text=True, errors="replace")
        reader = threading.Thread(target=self._split_output, daemon=True)
        reader.start()
        try:
            outcome = self._watch()
        finally:
            self.stop()
            reader.join(timeout=10)
            shutil.rmtree(self.tmp, ignore_errors=True)
        return outcome

    def _split_output(self):
        files = {}
        other = open(os.path.join(self.dir, "mpiexec.log"), "w")
        try:
            for line in self.proc.stdout:
                m = TAGGED.match(line.rstrip("\n"))
                if m is None:
                    other.write(line)
                    other.flush()
                    self.tails["mpiexec"].append(line.rstrip("\n"))
                    continue
                rank, text = int(m.group(1)), m.group(3)
                at = text.find(beats.MARK)
                if at >= 0:
                    self._beat(rank, text[at + len(beats.MARK):])
                    text = text[:at]  # what the rank's script had written of a line before the beat
                    if not text:
                        continue
                if rank not in files:
                    files[rank] = open(os.path.join(self.dir, f"rank-{rank}.log"), "w")
                files[rank].write(text + "\n")
                files[rank].flush()
                self.tails[rank].append(text)
                if rank == 0 and self.spec.echo:
                    print(f"[rank 0] {text}", flush=True)
        finally:
            for f in list(files.values()) + [other]:
                f.close()

    def _beat(self, rank, text):
        """Records one heartbeat of `rank` and keeps the last in the run directory."""
        beat = Heartbeat.parse(text)
        if beat is None:
            return  # cut short by a dying rank
        now = time.monotonic()
        with self._lock:
            previous = self.beats.get(rank)
            if previous is None or beat.progress != previous.progress or beat.exiting:
                self.moved[rank] = now
            self.heard[rank] = now
            self.beats[rank] = beat
            self.peak_rss[rank] = max(self.peak_rss[rank], beat.rss)
        path = os.path.join(self.heartbeat_dir, f"rank-{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(beat.to_dict(), f)
        os.replace(path + ".tmp", path)

    def _hung(self, now):
        """Why the attempt is stuck, with the rank to blame, once some rank passed the hang timeout;
        else (None, None). A rank that ticks no more (frozen, dead, or on a host cut off) explains
        the others stalling in a collective, so silent ranks are blamed first, as a whole host when
        every rank there fell silent while another host still ticks."""
        limit = self.spec.hang_timeout
        with self._lock:
            live = [r for r in range(self.np) if not (r in self.beats and self.beats[r].exiting)]
            done = [r for r, b in self.beats.items() if b.exiting]
            silent = {r: now - self.heard.get(r, self.started) for r in live}
            stalled = {r: now - self.moved.get(r, self.started) for r in live}
            hosts = {r: b.host for r, b in self.beats.items()}
        # Once a rank has exited, the others are finishing (closing sessions, MPI and Horovod
        # teardown over TCP can take seconds): they make no progress by design, so only a longer
        # wait counts against them. Silence still counts at once.
        stall_limit = max(limit, FINISH_GRACE_S) if done else limit
        if not any(t > limit for t in silent.values()) and not any(t > stall_limit for t in stalled.values()):
            return None, None, None
        quiet = sorted((r for r, t in silent.items() if t > 3 * self.tick), key=lambda r: -silent[r])
        if quiet:
            lost = silent_host(quiet, hosts)
            if lost:
                ranks = [r for r in quiet if hosts.get(r) == lost]
                return (f"host {lost} lost: no heartbeat from its rank(s) {ranks} for {silent[ranks[0]]:.0f} s "
                        f"(hang timeout {limit:.0f} s) while the other hosts' ranks still beat", ranks[0], lost)
            rank = quiet[0]
            where = f" on host {hosts[rank]}" if hosts.get(rank) else ""
            return (f"rank {rank}{where} sent no heartbeat for {silent[rank]:.0f} s (hang timeout {limit:.0f} s)"
                    f"{self._process_state(rank)}"), rank, None
        rank = max(stalled, key=lambda r: stalled[r])
        if done:
            return (f"rank {rank} did not finish within {stalled[rank]:.0f} s of its last progress, while rank(s) "
                    f"{sorted(done)} had exited{self._process_state(rank)}"), rank, None
        return (f"rank {rank} made no progress for {stalled[rank]:.0f} s (hang timeout {limit:.0f} s)"
                f"{self._process_state(rank)}"), rank, None

    def _check_memory(self):
        for rank, beat in list(self.beats.items()):
            rss = beat.rss
            total = beat.host_memory or psutil.virtual_memory().total
            if rss > self.spec.memory_share * total and rank not in self._warned_memory:
                self._warned_memory.add(rank)
                where = f" on host {beat.host}" if beat.host else ""
                log(f"rank {rank}{where} uses {rss / 2**30:.1f} GiB, over {self.spec.memory_share:.0%} of its host's "
                    f"{total / 2**30:.1f} GiB: the kernel may kill it")

    def _watch(self):
        last_line, tty = 0.0, sys.stdout.isatty()
        while True:
            now = time.monotonic()
            code = self.proc.poll()
            if code is not None:
                time.sleep(0.2)  # the last output lines and beats
                return self._ended(code)
            if self.interrupt.signal is not None:
                return Outcome(False, f"interrupted by signal {self.interrupt.signal}", interrupted=True)
            why, rank, lost = self._hung(now)
            if why is not None:
                self._dump_stacks()
                return Outcome(False, why, rank=rank, host=lost or self.host_of(rank), host_lost=bool(lost))
            self._check_memory()
            if self.on_tick is not None and self.resizing is None:
                self.on_tick(self)
            if tty or now - last_line >= self.spec.progress_every:
                self._progress_line(tty)
                last_line = now
            time.sleep(0.25)

    def all_ranks_beat(self):
        with self._lock:
            return len(self.beats) == self.np and not any(b.exiting for b in self.beats.values())

    def request_resize(self, why):
        """Asks every rank to save at the end of its current step and stop: SIGUSR2 to mpiexec, which
        forwards it to every rank on every host (rank_runtime/process/resize.py). Only once every rank beat:
        a rank that has not installed its handler yet would die of the signal."""
        self.resizing = why
        try:
            self.proc.send_signal(beats.RESIZE_SIGNAL)
        except OSError:
            pass

    def stopped_for_resize(self):
        """Whether the ranks confirmed that they stopped because the supervisor asked them to."""
        return self.resizing is not None and any(b.resize_stop for b in list(self.beats.values()))

    def last_step(self):
        """The furthest step any rank of this attempt reported."""
        steps = [b.step_or_batches() for b in list(self.beats.values())]
        steps = [s for s in steps if s is not None]
        return max(steps) if steps else None

    def host_of(self, rank):
        beat = self.beats.get(rank)
        return beat.host if beat is not None and beat.host else None

    def _dump_stacks(self):
        """Asks every rank of this attempt that runs on this host for its threads' stacks (SIGUSR1,
        rank_runtime/process/heartbeat.py), so that the logs say where a hung job was stuck."""
        mine = {p.pid for p in self.processes()}  # never signal a pid that is not this attempt's
        asked = []
        for rank, beat in sorted(list(self.beats.items())):
            if beat.pid in mine and not beat.exiting:
                try:
                    os.kill(beat.pid, beats.STACKS_SIGNAL)
                    asked.append(rank)
                except OSError:
                    pass
        if asked:
            time.sleep(1.0)  # the stacks travel through mpiexec's output
            log(f"the stacks of rank(s) {asked} at that moment are in their logs ({self.dir})")

    def _process_state(self, rank):
        pid = self.beats[rank].pid if rank in self.beats else None
        try:
            status = psutil.Process(pid).status() if pid else None
        except psutil.Error:
            return "; its process is gone"
        return f"; its process is {status}" if status else ""

    def _ended(self, code):
        beats = dict(self.beats)
        unfinished = [r for r, b in sorted(beats.items()) if not b.exiting]
        launcher = "\n".join(self.tails["mpiexec"])
        daemon = lost_daemon_host(launcher)
        # A host whose Open MPI daemon mpiexec lost, with ranks on it: that host, and every rank
        # there, is lost (more certain than which rank fell silent first, which a tick can blur).
        lost = daemon if daemon and any(b.host == daemon for b in beats.values()) else None
        lost_ranks = sorted(r for r, b in beats.items() if b.host == lost) if lost else []
        if code == 0:
            if not unfinished:
                return Outcome(True, exit_code=0)
            # Open MPI exits 0 after losing a remote host: judge by the ranks' own word.
            if lost:
                return Outcome(False, f"mpiexec exited 0 but rank(s) {unfinished} never finished: host {lost} (rank(s) "
                                      f"{lost_ranks}) was lost: mpiexec lost its daemon there",
                               rank=lost_ranks[0], exit_code=0, host=lost, host_lost=True, ranks=lost_ranks)
            # The host that fell silent first is the one lost; the others' ranks were killed after. Beats
            # come at most twice a second, so silences within one tick are a tie: an elastic job's ranks
            # on a host its discovery (run again now) no longer lists are the suspects first.
            now = time.monotonic()
            usable = self.usable_hosts() if self.usable_hosts else None
            gone = [r for r in unfinished if usable is not None and beats[r].host not in usable]
            first = max(gone or unfinished, key=lambda r: now - self.heard[r])
            return Outcome(False, f"mpiexec exited 0 but rank(s) {unfinished} never finished: host "
                                  f"{beats[first].host or '?'} (rank {first}) fell silent first, "
                                  f"{now - self.heard[first]:.0f} s before the end (a lost host?)",
                           rank=first, exit_code=0, host=beats[first].host, host_lost=True, ranks=[first])
        now = time.monotonic()
        cause = judge(Evidence(
            code, launcher, {r: "\n".join(self.tails[r]) for r in range(self.np)}, {r: b.host for r, b in beats.items()},
            unfinished, quiet=sorted((r for r in unfinished if now - self.heard[r] > 3 * self.tick),
                                     key=lambda r: self.heard[r]),
            listed=self.usable_hosts() if self.usable_hosts else None))
        return Outcome(False, cause.reason, rank=cause.rank, exit_code=code, host=cause.host, host_lost=cause.host_lost,
                       ranks=cause.ranks)

    def _progress_line(self, tty):
        beat = self.beats.get(0)
        if not beat:
            return
        step = beat.step_or_batches()
        parts = [f"attempt {self.number} on {self.np} rank(s)"]
        total = beat.total_steps
        if step is not None:
            parts.append(f"step {step}" + (f"/{total}" if total else ""))
            if total and tty:
                done = min(20, int(20 * step / total))
                parts.insert(1, "[" + "#" * done + "." * (20 - done) + "]")
        if beat.samples_per_s:
            parts.append(f"{beat.samples_per_s:.0f} samples/s")
        if beat.loss is not None:
            parts.append(f"loss {beat.loss:.4f}")
        elapsed = time.monotonic() - self.started
        if total and step:
            parts.append(f"ETA {max(0.0, elapsed * (total - step) / step):.0f} s")
        line = "  ".join(parts)
        if tty:
            print(f"\r[shardrec-run] {line}\033[K", end="", file=sys.stderr, flush=True)
        else:
            log(line)

    def processes(self):
        """Every process of this attempt still alive: mpiexec, its descendants, its session, and the
        ranks that reported their pid."""
        found = {}
        try:
            root = psutil.Process(self.proc.pid)
            for p in [root] + root.children(recursive=True):
                found[p.pid] = p
        except psutil.Error:
            pass
        for p in psutil.process_iter():
            try:
                if os.getsid(p.pid) == self.proc.pid:
                    found[p.pid] = p
            except (OSError, psutil.Error):
                continue
        for beat in list(self.beats.values()):
            pid = beat.pid
            if pid and pid not in found and psutil.pid_exists(pid):
                try:
                    found[pid] = psutil.Process(pid)
                except psutil.Error:
                    pass
        return [p for p in found.values() if p.pid != os.getpid()]

    def stop(self):
        """Kills every process of the attempt (a stopped rank too), checks that none survives, and
        removes the shared-memory segments they leave (job_kill.py)."""
        alive, removed = job_kill.kill_job(self.processes())
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if alive:
            raise RuntimeError(f"attempt {self.number}: processes {[p.pid for p in alive]} survived SIGKILL")
        if removed:
            log(f"attempt {self.number}: removed {len(removed)} shared-memory segment(s) its killed ranks left in "
                f"{job_kill.SHM}")


def _without_mpi_banners(lines):
    """A rank's last lines without Open MPI's boxed notices (MPI_ABORT ...), which say less than the
    rank's own last words."""
    out, inside = [], False
    for line in lines:
        if line.startswith("-" * 20):
            inside = not inside
            continue
        if not inside and line.strip():
            out.append(line)
    return out


def latest_checkpoint(directory):
    """(dense prefix, step) of the newest complete checkpoint in `directory`, or (None, None)."""
    if not directory or not os.path.isdir(directory):
        return None, None
    complete = [c for c in checkpoints.find_checkpoints(directory) if c.ok]
    if not complete:
        return None, None
    return complete[-1].dense_prefix, complete[-1].step


def _why_none(directory):
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
    def __init__(self, spec):
        self.spec = spec
        self.attempts = []

    def run(self):
        """Runs the job; returns the exit status: 0 done, 1 failed after the allowed restarts (or,
        elastic, fewer than --min-np slots for --elastic-timeout), 130 interrupted."""
        os.makedirs(self.spec.run_dir, exist_ok=True)
        log(f"run directory {self.spec.run_dir}")
        started = time.monotonic()
        resume, failures, resizes, number, placement = None, 0, 0, 0, None
        self.watch = (HostWatch(self.spec.elastic, log, os.path.join(self.spec.run_dir, "hosts.log"))
                      if self.spec.elastic else None)
        with _Interrupt() as interrupt:
            if self.watch:
                self.watch.start()  # wait_for_placement runs the script at once
            try:
                while True:
                    if self.watch:
                        before, placement = placement, self.watch.wait_for_placement(interrupt, first=number == 0)
                        if placement is None:
                            return self._too_few_hosts(started, before, interrupt, first=number == 0)
                        if before is None or placement != before:
                            log(f"attempt {number}: {placement.np} rank(s) on {placement.describe()}")
                    attempt = Attempt(self.spec, number, resume, interrupt, placement,
                                      *((self._maybe_grow, self._listed_hosts) if self.watch else ()))
                    self.attempts.append(attempt)
                    outcome = attempt.run()
                    last, step = latest_checkpoint(self.spec.checkpoint_dir)
                    attempt.ended = AttemptEnd(outcome.ok, outcome.reason or ("resized" if attempt.stopped_for_resize()
                                                                                   else "done"),
                                               host=outcome.host, host_lost=outcome.host_lost, ranks=outcome.ranks)
                    where = f"; the last complete checkpoint is {last} (step {step})" if last else ""
                    if outcome.interrupted:
                        log(f"stopped: {outcome.reason}; every rank is stopped{where}")
                        return 130
                    if outcome.ok and not attempt.stopped_for_resize():
                        self._summary(started, outcome)
                        return 0
                    self._steps_lost(attempt, step)
                    if outcome.ok:
                        resizes += 1
                        reached = attempt.last_step()
                        log(f"attempt {number} " + ("saved and stopped" if reached == step else
                                                    "stopped without a checkpoint of its last step") +
                            f" at step {reached} to grow ({attempt.resizing}); "
                            + (f"resuming from {last} (step {step})" if last else "starting again from step 0 (no "
                               "complete checkpoint)")
                            + ("" if reached == step else "; a script that saves when its loop ends loses no step"))
                        resume, number = last, number + 1
                        continue
                    log(f"attempt {number} failed: {outcome.reason}")
                    self._print_tail(attempt, outcome.rank)
                    if self.watch:
                        self._cool_down(outcome)
                    if failures == self.spec.max_restarts:
                        log(f"giving up after {number + 1} attempt(s) (--max-restarts {self.spec.max_restarts}){where}")
                        self._summary(started, outcome)
                        return 1
                    resume = last
                    # Doubling waits: a host that is down, or a cause that persists, is not retried in a
                    # burst that spends every restart within a second.
                    delay = min(MAX_RESTART_DELAY_S, self.spec.restart_delay * 2 ** failures)
                    failures += 1
                    log(f"restarting the job in {delay:.0f} s (attempt {number + 1} of "
                        f"{self.spec.max_restarts + 1 + resizes}) from "
                        + (f"{last} (step {step})" if last else "the start (no complete checkpoint"
                           + (f" in {self.spec.checkpoint_dir}{_why_none(self.spec.checkpoint_dir)})"
                              if self.spec.checkpoint_dir else ", no --checkpoint-dir)")))
                    if not self._wait(delay, interrupt):
                        log(f"stopped: interrupted by signal {interrupt.signal} before the restart{where}")
                        return 130
                    number += 1
            finally:
                if self.watch:
                    self.watch.stop()

    def _steps_lost(self, attempt, resumed_step):
        """Says how many steps the next attempt trains again: those since the checkpoint it resumes from."""
        reached = attempt.last_step()
        attempt.ended.reached_step = reached
        attempt.ended.steps_lost = lost = max(0, reached - (resumed_step or 0)) if reached is not None else None
        if lost:
            log(f"{lost} step(s) lost: the ranks had reached step {reached}, the next attempt resumes from step "
                f"{resumed_step or 0}")

    def _cool_down(self, outcome):
        """A lost host, or one whose ranks failed in two attempts in a row, stays out of the next
        attempts for its cooldown; a rank that failed once restarts on the same hosts."""
        attempt = self.attempts[-1]
        # The name the discovery script gave, which the placement uses (a rank's own hostname may differ).
        host = attempt.placement.host_of_rank(outcome.rank) if outcome.rank is not None else None
        host = host or outcome.host
        if host is None:
            return
        again = len(self.attempts) > 1 and self.attempts[-2].ended.host == host
        self.attempts[-1].ended.host = host
        if outcome.host_lost or again:
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
        self._summary(started, Outcome(False, reason))
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
        lines = attempt.tails.get(rank) if rank is not None else attempt.tails.get("mpiexec")
        if not lines:
            return
        name = f"rank {rank}" if rank is not None else "mpiexec"
        log(f"last lines of {name} ({os.path.join(attempt.dir, f'rank-{rank}.log' if rank is not None else 'mpiexec.log')}):")
        # mpiexec's own boxed notice is its message; a rank's last words say more than the boxes around them.
        for line in (list(lines)[-20:] if rank is None else _without_mpi_banners(list(lines))[-12:]):
            print(f"    {line}", file=sys.stderr)

    def _summary(self, started, outcome):
        last_beats = self.attempts[-1].beats if self.attempts else {}
        summary = {"ok": outcome.ok, "attempts": len(self.attempts), "restarts": max(0, len(self.attempts) - 1),
                   "seconds": round(time.monotonic() - started, 1), "reason": outcome.reason,
                   "failed_ranks": outcome.ranks, "lost_host": outcome.host if outcome.host_lost else None,
                   "ranks": {r: {"step": b.step, "train_batches": b.train_batches, "loss": b.loss,
                                 "samples_per_s": b.samples_per_s, "tables": b.tables or None}
                             | {"peak_rss": max(a.peak_rss.get(r, 0) for a in self.attempts)}
                             for r, b in sorted(last_beats.items())},
                   # Each attempt: its ranks and hosts, the checkpoint it restored, how it ended and the
                   # steps the next one trains again.
                   "attempt_list": [{"attempt": a.number, "np": a.np,
                                     "hosts": a.placement.mpiexec_hosts() if a.placement else self.spec.hosts,
                                     "resumed_from": a.resume_from} | (asdict(a.ended) if a.ended else {})
                                    for a in self.attempts]}
        totals = collections.Counter()
        for beat in last_beats.values():
            totals.update(beat.tables)
        summary["tables"] = dict(totals)  # keys held by all ranks together, per table
        for kind in ("admission", "tiers"):
            summed = {}
            for beat in last_beats.values():
                for table, counters in getattr(beat, kind).items():
                    summed.setdefault(table, collections.Counter()).update(counters)
            if summed:
                # Admission and eviction counters, and those of the storage tiers, summed over the ranks.
                summary[kind] = {table: dict(c) for table, c in sorted(summed.items())}
        if self.spec.checkpoint_dir and os.path.isdir(self.spec.checkpoint_dir):
            found = checkpoints.find_checkpoints(self.spec.checkpoint_dir, verify=False)
            summary["checkpoints"] = [c.name for c in found if c.ok]
        with open(os.path.join(self.spec.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        peak = ", ".join(f"rank {r}: {v['peak_rss'] / 2**20:.0f} MiB" for r, v in summary["ranks"].items())
        tables = ", ".join(f"{name} {size} keys" for name, size in sorted(summary["tables"].items()))
        tables += "".join(f"; {name}: " + ", ".join(f"{k} {v}" for k, v in c.items())
                          for name, c in summary.get("admission", {}).items())
        log(f"{'done' if outcome.ok else 'failed'}: {summary['attempts']} attempt(s), {summary['restarts']} restart(s), "
            f"{summary['seconds']} s; peak memory {peak or 'n/a'}; tables {tables or 'n/a'}; summary in "
            f"{os.path.join(self.spec.run_dir, 'summary.json')}")
