"""Everything the supervisor reads in mpiexec's output, in one place: the ranks' tagged lines, split
into one log per rank with their heartbeats taken out (split_output), and what a failed attempt's
output says about the cause: which rank failed, or which host was lost (judge).

Open MPI says a host is gone in several places, and whichever sees it first speaks: PRRTE (mpiexec's
runtime) when it loses the host's daemon, in one of two messages; a surviving rank's TCP transport
when its peer there hangs up ("Peer host: b"), before PRRTE notices; the elastic job's discovery
script, which stops listing the host; and the heartbeats, which stop arriving from it. A rank that
fails on its own says so instead (mpiexec's "exited on signal", the rank's exit hook, MPI_ABORT),
and that outranks a peer's complaint about it. judge() reads every source and returns the cause as
a small type the supervisor logs and writes to summary.json.
"""
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, TextIO, Union

from shardrec.rank_runtime.formats.heartbeat_format import MARK

# Open MPI's tagged output (`mpiexec --output tag`): [job,rank]<stream>: text
TAGGED = re.compile(r"^\[\d+,(\d+)\]<(stdout|stderr)>: ?(.*)$")
# A rank that failed by itself, most specific first: mpiexec saw its process die of a signal, its
# exit hook (rank_runtime/process/exit_hooks.py) or MPI_ABORT named it, or Open MPI's error box did.
_SIGNALLED_RANK = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on\s+signal")
_OWN_WORD_RANK = (re.compile(r"MPI_ABORT was invoked on rank (\d+)"), re.compile(r"\[rank (\d+)/\d+\] (?:uncaught|exiting)"))
_BOXED_RANK = re.compile(r"Process name: \[[^\]]*,(\d+)\]")
_EXIT_CODE = re.compile(r"Exit code:\s+(\d+)|Errorcode:\s+(\d+)")
_SIGNAL = re.compile(r"exited on\s+signal (\d+ \([^)]*\))")
# PRRTE names a lost host in one of two messages, whichever it meets first: the daemon's launcher
# exiting ("A daemon failed to report back ... Remote host: b") or its TCP link breaking
# ("PRTE has lost communication with a remote daemon ... Remote daemon: [...] on node b").
_REMOTE_HOST = re.compile(r"Remote host:\s+(\S+)|Remote daemon:\s+\S+ on node (\S+)")
# The TCP transport of a surviving rank, when its peer's connection breaks (help-mpi-btl-tcp.txt,
# "peer hung up"): its own host, then the peer's.
_PEER_HOST = re.compile(r"Peer host:\s+(\S+)")


def lost_daemon_host(launcher_output: str) -> Optional[str]:
    """The host whose Open MPI daemon mpiexec says it lost or could not start, if it says so."""
    found = _REMOTE_HOST.search(launcher_output)
    return (found.group(1) or found.group(2)) if found else None


def peer_hosts(text: str) -> List[str]:
    """The hosts that ranks' TCP transports say their peers hung up on, in order of report."""
    return list(dict.fromkeys(_PEER_HOST.findall(text)))


@dataclass
class Evidence:
    """What the supervisor has when an attempt ends."""
    code: int                      # mpiexec's exit status
    launcher: str                  # mpiexec's own (untagged) output
    rank_text: dict                # rank -> its last lines, one string
    hosts: dict                    # rank -> the host its heartbeats named
    unfinished: list               # ranks that beat but never said goodbye
    quiet: list = field(default_factory=list)  # unfinished ranks silent for several ticks, longest first
    listed: Optional[set] = None   # the hosts an elastic job's discovery lists now; None: not elastic


@dataclass
class Cause:
    reason: str
    ranks: list = field(default_factory=list)  # the ranks blamed (every rank of a lost host)
    host: Optional[str] = None
    host_lost: bool = False

    @property
    def rank(self) -> Optional[int]:
        return self.ranks[0] if self.ranks else None


def judge(ev: Evidence) -> Cause:
    """The cause of a failed attempt (mpiexec exited non-zero), from every source at hand."""
    text = ev.launcher + "\n" + "\n".join(ev.rank_text.values())
    daemon = lost_daemon_host(ev.launcher)
    if daemon and not ev.hosts:
        return Cause(f"mpiexec could not start its daemon on host {daemon}, or that host did not answer (mpiexec "
                     f"exited {ev.code}); check that the host is up, reachable from here and has this installation "
                     f"at the same path")
    signalled = _SIGNALLED_RANK.search(text)
    # Each pattern's first match, in the patterns' order (MPI_ABORT's rank before an exit hook's line).
    own = [int(m.group(1)) for pattern in _OWN_WORD_RANK for m in [pattern.search(text)] if m]
    said_so = {int(r) for pattern in _OWN_WORD_RANK for r in pattern.findall(text)}
    lost, sources = _lost_host(ev, text, daemon)
    if lost is not None:
        ranks = sorted(r for r, h in ev.hosts.items() if h == lost)
        # A rank there that failed by itself explains its peers' complaints, unless its daemon went too.
        failed_there = ({int(signalled.group(1))} if signalled else set()) | said_so
        if daemon == lost or not failed_there & set(ranks):
            return Cause(f"host {lost} lost, with rank(s) {ranks}: " + "; ".join(sources)
                         + f" (mpiexec exited {ev.code})", ranks, lost, host_lost=True)
    rank = (int(signalled.group(1)) if signalled else own[0] if own
            else next((int(m.group(1)) for m in [_BOXED_RANK.search(text)] if m), None))  # type: ignore[arg-type]
    status, killed = _EXIT_CODE.search(text), _SIGNAL.search(text)
    host = ev.hosts.get(rank) if rank is not None else None
    what = (f"rank {rank}" if rank is not None else "a rank") + (f" on host {host}" if host else "")
    detail = (f" (killed by signal {killed.group(1)})" if killed
              else f" (status {status.group(1) or status.group(2)})" if status else "")
    return Cause(f"{what} failed{detail}; mpiexec exited {ev.code}", [rank] if rank is not None else [], host)


def _lost_host(ev, text, daemon):
    """(the host every source at hand points to, what each said), or (None, [])."""
    with_ranks = set(ev.hosts.values())
    said = {}
    if daemon in with_ranks:
        said.setdefault(daemon, []).append("mpiexec lost its Open MPI daemon there")
    for host in peer_hosts(text):
        if host in with_ranks:
            reporters = sorted(r for r, t in ev.rank_text.items() if host in peer_hosts(t))
            who = f"rank(s) {reporters}'s" if reporters else "a rank's"
            said.setdefault(host, []).append(f"{who} MPI transport lost its peer there (Peer host: {host})")
    if ev.listed is not None:
        for host in sorted({ev.hosts[r] for r in ev.unfinished if ev.hosts.get(r) and ev.hosts[r] not in ev.listed}):
            said.setdefault(host, []).append("the discovery script no longer lists it")
    silent = silent_host(ev.quiet, ev.hosts)
    if silent:
        said.setdefault(silent, []).append("its rank(s) fell silent while the other hosts' still beat")
    if not said:
        return None, []
    # The daemon's loss is the most certain; then the host most sources agree on.
    host = daemon if daemon in said else max(said, key=lambda h: len(said[h]))
    return host, said[host]


def silent_host(quiet: Sequence[int], hosts: Dict[int, str]) -> Optional[str]:
    """The host whose every rank is quiet while some other host's rank is not, if there is one.
    quiet: ranks; hosts: rank -> host."""
    by_host: Dict[str, Set[int]] = {}
    for r, h in hosts.items():
        by_host.setdefault(h, set()).add(r)
    if len(by_host) < 2:
        return None
    lost = [h for h, ranks in by_host.items() if ranks <= set(quiet)]
    return lost[0] if len(lost) == 1 else None


LAUNCHER = "mpiexec"  # the name mpiexec's own lines (untagged) are kept under


def split_output(stream: Iterable[str], directory: str, on_line: Callable[[Union[int, str], str], None],
                 on_beat: Callable[[int, str], None], echo: Optional[Callable[[str], None]] = None) -> None:
    """Reads `stream` (mpiexec's output, `--output tag`) to its end: each rank's lines go to
    `<directory>/rank-<r>.log` and on_line(r, text), mpiexec's own to `mpiexec.log` and
    on_line(LAUNCHER, text); a heartbeat goes to on_beat(rank, text) and is cut out of its line;
    rank 0's lines also to echo(text) when given."""
    files: Dict[int, TextIO] = {}
    other = open(os.path.join(directory, f"{LAUNCHER}.log"), "w")
    try:
        for line in stream:
            m = TAGGED.match(line.rstrip("\n"))
            if m is None:
                other.write(line)
                other.flush()
                on_line(LAUNCHER, line.rstrip("\n"))
                continue
            rank, text = int(m.group(1)), m.group(3)
            at = text.find(MARK)
            if at >= 0:
                on_beat(rank, text[at + len(MARK):])
                text = text[:at]  # what the rank's script had written of a line before the beat
                if not text:
                    continue
            if rank not in files:
                files[rank] = open(os.path.join(directory, f"rank-{rank}.log"), "w")
            files[rank].write(text + "\n")
            files[rank].flush()
            on_line(rank, text)
            if rank == 0 and echo is not None:
                echo(text)
    finally:
        for f in list(files.values()) + [other]:
            f.close()


def without_mpi_banners(lines: Iterable[str]) -> List[str]:
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
