"""Which hosts an elastic job may use now: what the discovery script says, less the hosts that
failed recently (each out for a cooldown that doubles while it keeps failing), and where the ranks
of the next attempt go.

The discovery script is horovodrun's: a program printing one `host` or `host:slots` per line,
the hosts usable now (the Kubeflow MPI Operator's /etc/mpi/discover_hosts.sh is one).
"""
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

DISCOVERY_TIMEOUT_S = 10.0
_LINE = re.compile(r"([A-Za-z0-9_.\-]+)(?::(\d+))?")


class DiscoveryError(RuntimeError):
    """The discovery script failed, hung or printed something that is not a host list."""


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclass(frozen=True)
class Placement:
    """Where one attempt's ranks run: rank r on the r-th slot, hosts in the order given."""
    hosts: tuple  # of Host, each with the slots this attempt uses

    @property
    def np(self) -> int:
        return sum(h.slots for h in self.hosts)

    def mpiexec_hosts(self) -> str:
        return ",".join(f"{h.name}:{h.slots}" for h in self.hosts)

    def host_of_rank(self, rank: int) -> Optional[str]:
        """Open MPI's default mapping with -H: ranks fill each host's slots in turn."""
        for host in self.hosts:
            if rank < host.slots:
                return host.name
            rank -= host.slots
        return None

    def describe(self) -> str:
        return ", ".join(f"{h.name} ({h.slots})" for h in self.hosts)


def parse_hosts(text: str, slots_per_host: int, source: str) -> List["Host"]:
    """[Host] of a discovery script's output; DiscoveryError naming `source` and the line."""
    hosts = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.fullmatch(line)
        if m is None or (m.group(2) is not None and int(m.group(2)) < 1):
            raise DiscoveryError(f"{source}: line {number} {line[:80]!r} is not `host` or `host:slots` (slots >= 1)")
        hosts[m.group(1)] = Host(m.group(1), int(m.group(2)) if m.group(2) else slots_per_host)
    return list(hosts.values())


def discover(script: str, slots_per_host: int, timeout: float = DISCOVERY_TIMEOUT_S) -> List["Host"]:
    """The hosts `script` lists now."""
    try:
        proc = subprocess.run([script], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"host discovery script {script}: no answer in {timeout:.0f} s") from None
    except OSError as e:
        raise DiscoveryError(f"host discovery script {script}: cannot run it ({e.strerror})") from None
    if proc.returncode != 0:
        raise DiscoveryError(f"host discovery script {script}: exit status {proc.returncode}"
                             + (f": {proc.stderr.strip()[-300:]}" if proc.stderr.strip() else ""))
    return parse_hosts(proc.stdout, slots_per_host, f"host discovery script {script}")


class Cooldowns:
    """Hosts that failed stay out of new attempts for a while: `low` seconds after a first
    failure, twice as long after each further one, at most `high`."""

    def __init__(self, low, high):
        self.low, self.high = low, high
        self.failures, self.until = {}, {}

    def failed(self, host: str, now: Optional[float] = None) -> float:
        now = time.monotonic() if now is None else now
        self.failures[host] = self.failures.get(host, 0) + 1
        seconds = min(self.high, self.low * 2 ** (self.failures[host] - 1))
        self.until[host] = now + seconds
        return seconds

    def cooling(self, now: Optional[float] = None) -> Dict[str, float]:
        """{host: seconds left} of the hosts still out."""
        now = time.monotonic() if now is None else now
        return {h: t - now for h, t in self.until.items() if t > now}


def place(hosts: List["Host"], cooling: Dict[str, float], most: int) -> Placement:
    """The placement of at most `most` ranks on `hosts` (in their order), leaving out those cooling."""
    chosen, left = [], most
    for host in hosts:
        if left == 0:
            break
        if host.name in cooling:
            continue
        take = min(host.slots, left)
        chosen.append(Host(host.name, take))
        left -= take
    return Placement(tuple(chosen))
