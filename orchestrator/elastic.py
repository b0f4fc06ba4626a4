"""An elastic job's view of its hosts between and during attempts (shardrec-run
--host-discovery-script): the hosts usable now, the failed ones cooling down, the placement of the
next attempt, and whether a running attempt could grow.

The job keeps no state outside its checkpoints, and a checkpoint of N ranks restores into any
number of ranks exactly, so changing the number of ranks is a restart from the last checkpoint:
after a failure on the hosts left, and to grow, at a point the ranks agree on (resize.py on the
rank side saves there and stops).
"""
import threading
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from .hosts import Cooldowns, DiscoveryError, Host, Placement, discover, place


@dataclass
class ElasticSpec:
    discovery: str               # the host discovery script
    min_np: int
    max_np: int
    start_np: Optional[int] = None  # slots to wait for before the first attempt (-np; default min_np)
    slots_per_host: int = 1
    timeout: float = 600.0       # how long to wait for start_np / min_np slots before giving up
    cooldown: tuple = (10.0, 300.0)  # seconds a failed host stays out: first failure, most
    poll_every: float = 1.0      # seconds between discoveries while an attempt runs (horovodrun's)


class HostWatch:
    """Runs the discovery script every `poll_every` seconds in a thread of its own (a script that
    hangs never stalls the watch of the ranks) and keeps its last good answer."""

    def __init__(self, spec: ElasticSpec, log, record):
        """log: a line to the terminal; record: a file that keeps every line said of the hosts."""
        self.spec, self._log, self.record = spec, log, record
        self.cooldowns = Cooldowns(*spec.cooldown)
        self.hosts: Optional[List[Host]] = None  # the last good answer
        self._error: Optional[str] = None  # the last error said, so that a lasting one is said once
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def log(self, text: str) -> None:
        self._log(text)
        with open(self.record, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {text}\n")

    def refresh(self) -> Optional[List[Host]]:
        """Runs the script once; on failure says why and keeps the hosts known before."""
        try:
            hosts = discover(self.spec.discovery, self.spec.slots_per_host)
        except DiscoveryError as e:
            if str(e) != self._error:
                kept = ", ".join(f"{h.name}:{h.slots}" for h in self.hosts) if self.hosts else "none yet"
                self.log(f"{e}; keeping the hosts known before ({kept})")
            self._error = str(e)
            return self.hosts
        with self._lock:
            if self._error is not None:
                self.log(f"host discovery script {self.spec.discovery} answers again")
            self._error = None
            if self.hosts is not None and [h.name for h in hosts] != [h.name for h in self.hosts]:
                self.log("hosts now: " + (", ".join(f"{h.name}:{h.slots}" for h in hosts) or "none"))
            self.hosts = hosts
        return hosts

    def start(self) -> None:
        self._stop.clear()
        thread = threading.Thread(target=self._poll, daemon=True, name="host-discovery")
        thread.start()
        self._thread = thread

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _poll(self):
        while not self._stop.wait(self.spec.poll_every):
            self.refresh()

    def placement(self) -> Placement:
        """Where the ranks of an attempt started now would go (at most max_np of them)."""
        with self._lock:
            hosts = list(self.hosts or [])
        return place(hosts, self.cooldowns.cooling(), self.spec.max_np)

    def needed(self, first: bool) -> Tuple[int, str]:
        """(slots, the option that asks for them): horovodrun's rule, -np to start with, --min-np to
        go on with after a failure."""
        if first and self.spec.start_np:
            return self.spec.start_np, f"-np {self.spec.start_np} (to start with)"
        return self.spec.min_np, f"--min-np {self.spec.min_np}"

    def wait_for_placement(self, interrupt: Any, first: bool = False) -> Optional[Placement]:
        """A placement of at least the slots needed (needed(first)), waiting up to the elastic
        timeout; None when none came (or SIGINT / SIGTERM)."""
        need, option = self.needed(first)
        deadline = time.monotonic() + self.spec.timeout
        said = False
        while True:
            self.refresh()
            placement = self.placement()
            if placement.np >= need:
                return placement
            if not said:
                cooling = self.cooldowns.cooling()
                self.log(f"{placement.np} slot(s) usable ({placement.describe() or 'no host'}), fewer than {option}"
                         + ("; cooling down after failures: " + ", ".join(
                             f"{h} ({t:.0f} s)" for h, t in sorted(cooling.items())) if cooling else "")
                         + f"; waiting up to {self.spec.timeout:.0f} s (--elastic-timeout)")
                said = True
            if time.monotonic() >= deadline or interrupt.signal is not None:
                return None
            time.sleep(min(1.0, self.spec.poll_every))

    def can_grow(self, np: int) -> Optional[Placement]:
        """The larger placement an attempt of `np` ranks could grow to now, else None."""
        if np >= self.spec.max_np:
            return None
        placement = self.placement()
        return placement if placement.np > np else None
