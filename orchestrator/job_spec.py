"""What a supervised job is: the command its ranks run and how the supervisor runs it (launch/run_cli.py
builds one from shardrec-run's options; supervisor.py and attempt.py read it)."""
from dataclasses import dataclass, field
from typing import List, Optional

from .elastic import ElasticSpec


@dataclass
class JobSpec:
    command: List[str]                  # what every rank runs, an argument list
    np: int
    run_dir: str
    max_restarts: int = 3
    hang_timeout: float = 300.0         # seconds without progress before a rank counts as hung
    checkpoint_dir: Optional[str] = None  # where the job saves; restarts resume from its last complete checkpoint
    hosts: Optional[str] = None         # mpiexec -H
    hostfile: Optional[str] = None      # mpiexec --hostfile
    forward_env: List[str] = field(default_factory=list)  # mpiexec -x, for remote hosts
    mpiexec_args: List[str] = field(default_factory=list)
    memory_share: float = 0.9           # warn when a rank's RSS passes this share of the host's memory
    restart_delay: float = 5.0          # seconds before the first restart, doubled for each one after
    echo: bool = True                   # rank 0's output on this terminal
    progress_every: float = 10.0        # seconds between progress lines when stdout is not a terminal
    elastic: Optional[ElasticSpec] = None  # --host-discovery-script and friends: the job shrinks and grows
    stop_timeout: float = 120.0         # seconds the ranks get to save and exit after SIGTERM / SIGINT
