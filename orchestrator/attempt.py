"""One attempt of a supervised job: mpiexec started in a process session of its own, its output split
per rank (mpiexec_output.py), every rank's heartbeats watched for silence, stalls and memory, and
how it ended judged; then every process of it killed and checked gone, with the shared memory its
killed ranks leave (job_kill.py). The supervisor (supervisor.py) decides what comes next."""
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Set, Tuple, Union

import psutil

from . import job_kill
from .job_spec import JobSpec
from .mpiexec_output import LAUNCHER, Evidence, judge, lost_daemon_host, silent_host, split_output
from .run_summary import AttemptEnd, write_json
from shardrec.rank_runtime.formats import heartbeat_format as beats
from shardrec.rank_runtime.formats.heartbeat_format import Heartbeat

TAIL_LINES = 60
FINISH_GRACE_S = 60.0  # how long ranks may take to finish once one rank has exited
START_GRACE_S = 60.0  # how long a rank may take to send its first heartbeat, hang timeout or not
READER_DRAIN_S = 10.0  # how long the end of the ranks' output may take to arrive once mpiexec exited


def log(text: str) -> None:
    print(f"[shardrec-run {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


class Attempt:
    def __init__(self, spec: JobSpec, number: int, resume_from: Optional[str], interrupt, placement=None, on_tick=None,
                 usable_hosts=None, history: Tuple[int, int] = (0, 0)):
        """placement: where the ranks go (an elastic job's hosts.Placement), else spec's -np and
        hosts; on_tick(attempt): called on every turn of the watch loop (an elastic job's growth);
        usable_hosts(): the host names an elastic job's discovery lists now; history: the job's
        restarts after failures and resizes before this attempt."""
        self.spec, self.number, self.resume_from, self.interrupt = spec, number, resume_from, interrupt
        self.placement, self.on_tick, self.usable_hosts = placement, on_tick, usable_hosts
        self.np = placement.np if placement else spec.np
        self.resizing: Optional[str] = None  # why the supervisor asked the ranks to save and stop, once it did
        self.stopping: Optional[float] = None  # when the supervisor asked the ranks to save and stop for good (SIGTERM)
        self.history = history
        self.ended: Optional[AttemptEnd] = None  # once it has (run() returns it)
        self.dir = os.path.join(spec.run_dir, f"attempt-{number}")
        self.heartbeat_dir = os.path.join(self.dir, "heartbeat")
        os.makedirs(self.heartbeat_dir, exist_ok=True)
        self.tails: Dict[object, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=TAIL_LINES))
        self._lock = threading.Lock()  # the output reader records beats, the watch loop judges them
        self.beats: Dict[int, Heartbeat] = {}  # rank -> last heartbeat
        self.moved: Dict[int, float] = {}      # rank -> supervisor time its progress last changed
        self.heard: Dict[int, float] = {}      # rank -> supervisor time its last beat arrived
        self.peak_rss: Dict[int, int] = collections.defaultdict(int)
        self._warned_memory: Set[int] = set()
        # Ticks often enough that a silent rank stands out well within the hang timeout.
        self.tick = min(5.0, max(0.2, spec.hang_timeout / 6))

    def command(self) -> List[str]:
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
        forwarded = [beats.RUN_DIR_ENV, beats.ATTEMPT_ENV, beats.INTERVAL_ENV, beats.RESTARTS_ENV, beats.RESIZES_ENV]
        if self.resume_from:
            forwarded.append(beats.RESUME_ENV)
        for name in forwarded + list(self.spec.forward_env):
            cmd += ["-x", name]
        return cmd + list(self.spec.mpiexec_args) + list(self.spec.command)

    def run(self) -> AttemptEnd:
        """Runs the attempt to its end, and says how it ended (also kept as self.ended)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{beats.RUN_DIR_ENV: self.dir,
                                                         beats.ATTEMPT_ENV: str(self.number),
                                                         beats.INTERVAL_ENV: str(self.tick)})
        if self.resume_from:
            env[beats.RESUME_ENV] = self.resume_from
        env[beats.RESTARTS_ENV], env[beats.RESIZES_ENV] = map(str, self.history)
        # MPI's waits yield their core to the rank's other threads (rank_runtime/process/host_defaults.py says
        # why), on every host: mpiexec passes OMPI_MCA_* variables to all ranks.
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
        # Open MPI's session files in a directory of this attempt's own, removed when it ends: a killed
        # attempt leaves its rendezvous files behind, and a later mpiexec that gets the same PID (they
        # are reused; 32768 of them here) cannot start ("The PMIx server's listener thread failed").
        self.tmp = tempfile.mkdtemp(prefix="shardrec-mpi-")
        env["TMPDIR"] = self.tmp
        cmd = self.command()
        write_json(os.path.join(self.dir, "command.json"),
                   {"command": cmd, "resume_from": self.resume_from, "np": self.np,
                    "hosts": self.placement.mpiexec_hosts() if self.placement else self.spec.hosts}, indent=1)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True, text=True, errors="replace")
        echo = (lambda text: print(f"[rank 0] {text}", flush=True)) if self.spec.echo else None
        reader = threading.Thread(target=split_output, args=(self.proc.stdout, self.dir, self.record_line, self._beat, echo),
                                  daemon=True)
        reader.start()
        try:
            end = self._watch(reader)
        finally:
            self.stop()
            reader.join(timeout=10)
            shutil.rmtree(self.tmp, ignore_errors=True)
        if end.ok and not end.reason:
            end.reason = "resized" if self.stopped_for_resize() else "done"
        end.reached_step = self.last_step()
        self.ended = end
        return end

    def count_steps_lost(self, resumed_step: Optional[int]) -> Optional[int]:
        """The steps the next attempt trains again, from `resumed_step` (the checkpoint it resumes
        from) to the step this one reached; kept in self.ended."""
        assert self.ended is not None
        reached = self.ended.reached_step
        self.ended.steps_lost = max(0, reached - (resumed_step or 0)) if reached is not None else None
        return self.ended.steps_lost

    def blame_host(self, host: str) -> None:
        """The host the supervisor holds its failure against (an elastic job's name for it)."""
        assert self.ended is not None
        self.ended.host = host

    def record_line(self, rank: Union[int, str], text: str) -> None:
        """A line of `rank`'s output (or mpiexec's: rank LAUNCHER), kept in its tail."""
        self.tails[rank].append(text)

    def _beat(self, rank, text):
        beat = Heartbeat.parse(text)
        if beat is not None:  # else cut short by a dying rank
            self.record_beat(rank, beat, time.monotonic())

    def record_beat(self, rank: int, beat: Heartbeat, now: float) -> None:
        """Records one heartbeat of `rank`, arrived at `now` (time.monotonic()), and keeps the last
        in the run directory."""
        with self._lock:
            previous = self.beats.get(rank)
            if previous is not None and previous.exiting:
                beat.exiting = True  # a rank that said it exits has: no beat can take that back
            if previous is None or beat.progress != previous.progress or beat.exiting:
                self.moved[rank] = now
            self.heard[rank] = now
            self.beats[rank] = beat
            self.peak_rss[rank] = max(self.peak_rss[rank], beat.rss)
        write_json(os.path.join(self.heartbeat_dir, f"rank-{rank}.json"), beat.to_dict())

    def hung(self, now: float) -> Tuple[Optional[str], Optional[int], Optional[str]]:
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
            progressed = {r for r, b in self.beats.items() if b.progress > 0}
            # A rank whose stream has no new data waits for it, and the others wait for it in the key
            # exchange (whose own timeout bounds that): no progress by design.
            waiting = any(self.beats[r].waiting_for_data for r in live if r in self.beats)
        if waiting:
            stalled = {}
        # Once a rank has exited, the others are finishing (closing sessions, MPI and Horovod
        # teardown over TCP can take seconds): they make no progress by design, so only a longer
        # wait counts against them. Silence still counts at once.
        stall_limit = max(limit, FINISH_GRACE_S) if done else limit
        # A rank not heard from yet is starting (importing TensorFlow, joining MPI), and one that beats
        # but has made no progress yet is too (building its graph, restoring a checkpoint, or waiting
        # in the first collective for a peer that is): on a busy machine that alone can take longer
        # than a short hang timeout, so it gets START_GRACE_S. Silence counts at the hang timeout.
        start_limit = max(limit, START_GRACE_S)
        over = [r for r, t in silent.items() if t > (limit if r in self.heard else start_limit)]
        if not over and not any(t > (stall_limit if r in progressed else max(stall_limit, start_limit))
                                for r, t in stalled.items()):
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

    def _watch(self, reader):
        last_line, tty = 0.0, sys.stdout.isatty()
        while True:
            now = time.monotonic()
            code = self.proc.poll()
            if code is not None:
                # The ranks' last lines and exit beats may still be in the pipe: judged once the reader
                # has seen its end (a fixed pause lost a rank's last beat on a busy machine). Bounded:
                # a process the job left behind may hold the pipe open.
                reader.join(timeout=READER_DRAIN_S)
                return self.judge_end(code)
            if self.interrupt.signal is not None:
                if self.stopping is None and self.interrupt.count == 1 and self.all_ranks_beat():
                    self.request_stop()
                elif (self.stopping is None or self.interrupt.count > 1
                      or now - self.stopping > self.spec.stop_timeout):
                    return AttemptEnd(False, f"interrupted by signal {self.interrupt.signal}", interrupted=True)
            why, rank, lost = self.hung(now)
            if why is not None:
                self._dump_stacks()
                return AttemptEnd(False, why, rank=rank, host=lost or self.host_of(rank), host_lost=bool(lost))
            self._check_memory()
            if self.on_tick is not None and self.resizing is None:
                self.on_tick(self)
            if tty or now - last_line >= self.spec.progress_every:
                self.progress_line(tty)
                last_line = now
            time.sleep(0.25)

    def all_ranks_beat(self) -> bool:
        with self._lock:
            return len(self.beats) == self.np and not any(b.exiting for b in self.beats.values())

    def request_resize(self, why: str) -> None:
        """Asks every rank to save at the end of its current step and stop: SIGUSR2 to mpiexec, which
        forwards it to every rank on every host (rank_runtime/process/resize.py). Only once every rank beat:
        a rank that has not installed its handler yet would die of the signal."""
        self.resizing = why
        try:
            self.proc.send_signal(beats.RESIZE_SIGNAL)
        except OSError:
            pass

    def request_stop(self) -> None:
        """The first SIGTERM or SIGINT: every rank finishes its step, saves and exits, as for a resize;
        a second signal, or spec.stop_timeout without the job ending, stops every process at once."""
        self.stopping = time.monotonic()
        log(f"signal {self.interrupt.signal}: every rank finishes its step, saves and stops (within "
            f"{self.spec.stop_timeout:.0f} s; a second signal stops them at once)")
        try:
            self.proc.send_signal(beats.RESIZE_SIGNAL)
        except OSError:
            pass

    def stopped_for_resize(self) -> bool:
        """Whether the ranks confirmed that they stopped because the supervisor asked them to."""
        return self.resizing is not None and any(b.resize_stop for b in list(self.beats.values()))

    def last_step(self) -> Optional[int]:
        """The furthest step any rank of this attempt reported."""
        steps = [b.step_or_batches() for b in list(self.beats.values())]
        steps = [s for s in steps if s is not None]
        return max(steps) if steps else None

    def host_of(self, rank: Optional[int]) -> Optional[str]:
        beat = self.beats.get(rank) if rank is not None else None
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

    def judge_end(self, code: int, now: Optional[float] = None) -> AttemptEnd:
        """How the attempt ended, mpiexec having exited with `code` at `now` (default: now), from
        the ranks' beats and the output's tails."""
        now = time.monotonic() if now is None else now
        beats = dict(self.beats)
        unfinished = [r for r, b in sorted(beats.items()) if not b.exiting]
        launcher = "\n".join(self.tails[LAUNCHER])
        daemon = lost_daemon_host(launcher)
        # A host whose Open MPI daemon mpiexec lost, with ranks on it: that host, and every rank
        # there, is lost (more certain than which rank fell silent first, which a tick can blur).
        lost = daemon if daemon and any(b.host == daemon for b in beats.values()) else None
        lost_ranks = sorted(r for r, b in beats.items() if b.host == lost) if lost else []
        if code == 0:
            if not unfinished:
                return AttemptEnd(True, exit_code=0)
            # Open MPI exits 0 after losing a remote host: judge by the ranks' own word.
            if lost:
                return AttemptEnd(False, f"mpiexec exited 0 but rank(s) {unfinished} never finished: host {lost} (rank(s) "
                                      f"{lost_ranks}) was lost: mpiexec lost its daemon there",
                               rank=lost_ranks[0], exit_code=0, host=lost, host_lost=True, ranks=lost_ranks)
            # The host that fell silent first is the one lost; the others' ranks were killed after. Beats
            # come at most twice a second, so silences within one tick are a tie: an elastic job's ranks
            # on a host its discovery (run again now) no longer lists are the suspects first.
            usable = self.usable_hosts() if self.usable_hosts else None
            gone = [r for r in unfinished if usable is not None and beats[r].host not in usable]
            first = max(gone or unfinished, key=lambda r: now - self.heard[r])
            return AttemptEnd(False, f"mpiexec exited 0 but rank(s) {unfinished} never finished: host "
                                  f"{beats[first].host or '?'} (rank {first}) fell silent first, "
                                  f"{now - self.heard[first]:.0f} s before the end (a lost host?)",
                           rank=first, exit_code=0, host=beats[first].host, host_lost=True, ranks=[first])
        cause = judge(Evidence(
            code, launcher, {r: "\n".join(self.tails[r]) for r in range(self.np)}, {r: b.host for r, b in beats.items()},
            unfinished, quiet=sorted((r for r in unfinished if now - self.heard[r] > 3 * self.tick),
                                     key=lambda r: self.heard[r]),
            listed=self.usable_hosts() if self.usable_hosts else None))
        return AttemptEnd(False, cause.reason, rank=cause.rank, exit_code=code, host=cause.host, host_lost=cause.host_lost,
                       ranks=cause.ranks)

    def progress_line(self, tty: bool) -> None:
        """Rank 0's step, speed, loss and ETA: a bar redrawn in place on a terminal, else a log line."""
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

    def processes(self) -> List[psutil.Process]:
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

    def stop(self) -> None:
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
