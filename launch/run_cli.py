"""shardrec-run: start a training job on N ranks under the supervisor.

    shardrec-run -np N [-H host:slots,...] [--hostfile F] [-x VAR]... [--max-restarts K]
                 [--restart-delay S] [--hang-timeout S] [--stop-timeout S] [--checkpoint-dir D] [--run-dir D]
                 [--] COMMAND...
    shardrec-run -np N --host-discovery-script P --checkpoint-dir D [--min-np A] [--max-np B]
                 [--slots-per-host S] [--elastic-timeout S] [--blacklist-cooldown-range LO HI] ... COMMAND...

COMMAND is what every rank runs, as with mpirun and horovodrun (`shardrec-run -np 2 python
train.py --epochs 3`). The supervisor keeps each rank's output in <run dir>/attempt-<k>/rank-<r>.log
(rank 0's also here), follows the ranks' heartbeats, and when a rank dies or makes no progress for
--hang-timeout seconds stops every process of the job and starts it again, resuming from the last
complete checkpoint of --checkpoint-dir (the ranks find it through shardrec's resume_checkpoint(),
or by themselves in Estimator / MonitoredTrainingSession jobs), at most --max-restarts times.

Elastic (with --host-discovery-script, horovodrun's options): the hosts are those the script
prints now (`host` or `host:slots` per line); each attempt runs as many ranks as fit, up to
--max-np: the first once -np slots are usable, a later one once --min-np are. A failed host stays
out for a cooldown, and the job goes on with the ranks left from the last checkpoint, resharded;
when hosts come back, the ranks save at the end of their step and the job goes on with more.

SIGTERM or SIGINT (Ctrl-C) asks every rank to finish its step, save and exit (the job's training input
ends at the same batch on every rank, and a script that saves when its loop ends saves that step);
the supervisor then exits 0. A second signal, or --stop-timeout seconds without the job ending,
stops every process at once (exit 130).

Exit status: 0 done (or stopped and saved on request), 1 failed after the allowed restarts (or fewer than -np slots at the start,
--min-np later, for --elastic-timeout seconds), 2 bad arguments, 130 interrupted.
"""
import argparse
import os
import shutil
import socket
import sys
import time
from typing import List, Optional, Tuple

from shardrec.orchestrator.elastic import ElasticSpec
from shardrec.orchestrator.job_spec import JobSpec
from shardrec.orchestrator.supervisor import Supervisor


def _check_command(command):
    """The program must exist; for `python SCRIPT`, so must the script (a typo fails here, not on N ranks)."""
    if not command:
        raise ValueError("no COMMAND: give what every rank runs, e.g. shardrec-run -np 2 python train.py")
    program = command[0]
    if shutil.which(program) is None and not os.access(program, os.X_OK):
        raise ValueError(f"{program!r}: no such program (not on PATH, not an executable file)")
    if os.path.basename(program).startswith("python"):
        args = [a for a in command[1:] if not a.startswith("-")]
        if not any(a in ("-m", "-c") for a in command[1:]) and args and not os.path.isfile(args[0]):
            raise ValueError(f"{args[0]!r}: no such script (relative to {os.getcwd()})")


def host_names(hosts: Optional[str], hostfile: Optional[str]) -> List[Tuple[str, str]]:
    """(name, where it was given) of every host in -H and the hostfile."""
    names = [(h.split(":")[0], "-H") for h in (hosts or "").split(",") if h.strip()]
    if hostfile:
        with open(hostfile) as f:
            for number, line in enumerate(f, 1):
                words = line.split("#", 1)[0].split()
                if words:
                    names.append((words[0], f"{hostfile} line {number}"))
    return names


def _check_hosts(hosts, hostfile):
    """Every host name must resolve here: a typo fails before anything starts, not as a launch
    timeout. (Whether a host answers is known only when mpiexec reaches it; the supervisor names it.)"""
    for name, where in host_names(hosts, hostfile):
        try:
            socket.getaddrinfo(name, None)
        except socket.gaierror as e:
            raise ValueError(f"host {name!r} ({where}): its name does not resolve ({e.strerror}); "
                             f"allowed: a name or address this machine can reach") from None


def _parse(argv):
    p = argparse.ArgumentParser(prog="shardrec-run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-np", "-n", dest="np", type=int, required=True, help="number of ranks")
    p.add_argument("-H", "--host", dest="hosts", help="hosts as host:slots,... (as mpirun -H)")
    p.add_argument("--hostfile", help="an Open MPI hostfile (`host slots=N` per line)")
    p.add_argument("-x", dest="forward_env", action="append", default=[],
                   help="forward this environment variable to every rank (repeatable)")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--restart-delay", type=float, default=5.0,
                   help="seconds before the first restart, doubled for each later one, at most 300 (default 5)")
    p.add_argument("--hang-timeout", type=float, default=300.0,
                   help="seconds a rank may make no progress before it counts as hung (default 300)")
    p.add_argument("--stop-timeout", type=float, default=120.0,
                   help="seconds the ranks get to save and exit after SIGTERM / SIGINT (default 120)")
    p.add_argument("--checkpoint-dir", help="the job's checkpoint directory: restarts resume from its last "
                                            "complete checkpoint")
    p.add_argument("--run-dir", help="where logs, heartbeats and the summary go "
                                     "(default shardrec-runs/<date>-<time>-<pid>)")
    p.add_argument("--memory-share", type=float, default=0.9,
                   help="report a rank whose memory passes this share of the host's (default 0.9)")
    p.add_argument("--mpiexec-arg", dest="mpiexec_args", action="append", default=[],
                   help="one more argument for mpiexec (repeatable), e.g. --mpiexec-arg=--bind-to "
                        "--mpiexec-arg=core")
    elastic = p.add_argument_group("elastic jobs (horovodrun's options)")
    elastic.add_argument("--host-discovery-script", help="a program printing the usable hosts, one `host` or "
                                                         "`host:slots` per line; makes the job elastic")
    elastic.add_argument("--min-np", type=int, help="fewest ranks to go on with (default -np)")
    elastic.add_argument("--max-np", type=int, help="most ranks to grow to (default -np)")
    elastic.add_argument("--slots-per-host", type=int, default=1, help="slots of a host the script lists without "
                                                                       "any (default 1)")
    elastic.add_argument("--elastic-timeout", type=float, default=600.0,
                         help="seconds to wait for -np slots at the start, --min-np after a failure, "
                              "before giving up (default 600)")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("LOW", "HIGH"),
                         default=[10.0, 300.0], help="seconds a failed host stays out: LOW after its first failure, "
                                                     "doubled for each further one, at most HIGH (default 10 300)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="what every rank runs")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if args.np < 1:
        p.error(f"-np {args.np}: the number of ranks must be at least 1")
    if args.max_restarts < 0:
        p.error(f"--max-restarts {args.max_restarts}: allowed: 0 (never restart) or more")
    if not 0 <= args.restart_delay <= 3600:
        p.error(f"--restart-delay {args.restart_delay}: allowed: 0 to 3600 seconds")
    if not args.hang_timeout > 0:
        p.error(f"--hang-timeout {args.hang_timeout}: allowed: a number of seconds > 0")
    if not args.stop_timeout > 0:
        p.error(f"--stop-timeout {args.stop_timeout}: allowed: a number of seconds > 0")
    if not 0 < args.memory_share <= 1:
        p.error(f"--memory-share {args.memory_share}: allowed: (0, 1]")
    if args.hostfile and not os.access(args.hostfile, os.R_OK):
        p.error(f"--hostfile {args.hostfile}: cannot be read")
    _check_elastic(p, args)
    try:
        _check_command(args.command)
        _check_hosts(args.hosts, args.hostfile)
    except ValueError as e:
        p.error(str(e))
    return args


def _check_elastic(p, args):
    given = [f"--{name.replace('_', '-')}" for name in ("min_np", "max_np") if getattr(args, name) is not None]
    if args.host_discovery_script is None:
        if given:
            p.error(f"{given[0]} needs --host-discovery-script (the hosts an elastic job may use)")
        return
    script = args.host_discovery_script
    if not os.path.isfile(script) or not os.access(script, os.X_OK):
        p.error(f"--host-discovery-script {script}: " + ("not an executable file (chmod +x?)" if os.path.exists(script)
                                                        else "no such file") + "; allowed: a program printing "
                "`host` or `host:slots` per line")
    args.min_np = args.np if args.min_np is None else args.min_np
    args.max_np = args.np if args.max_np is None else args.max_np
    if not 1 <= args.min_np <= args.np:
        p.error(f"--min-np {args.min_np}: allowed: 1 to -np ({args.np})")
    if args.max_np < args.np:
        p.error(f"--max-np {args.max_np}: allowed: -np ({args.np}) or more")
    if args.slots_per_host < 1:
        p.error(f"--slots-per-host {args.slots_per_host}: allowed: 1 or more")
    if not args.elastic_timeout > 0:
        p.error(f"--elastic-timeout {args.elastic_timeout}: allowed: a number of seconds > 0")
    low, high = args.blacklist_cooldown_range
    if not 0 <= low <= high:
        p.error(f"--blacklist-cooldown-range {low:g} {high:g}: allowed: 0 <= LOW <= HIGH seconds")
    if args.hosts or args.hostfile:
        p.error("-H / --hostfile with --host-discovery-script: the script says which hosts an elastic job uses")
    if not args.checkpoint_dir:
        p.error("--host-discovery-script needs --checkpoint-dir: an elastic job changes its ranks by restarting from "
                "its last checkpoint")


def main(argv: Optional[List[str]] = None) -> int:
    args = _parse(argv)
    run_dir = args.run_dir or os.path.join("shardrec-runs", time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
    spec = JobSpec(command=args.command, np=args.np, run_dir=os.path.abspath(run_dir), max_restarts=args.max_restarts,
                   hang_timeout=args.hang_timeout, stop_timeout=args.stop_timeout,
                   checkpoint_dir=os.path.abspath(args.checkpoint_dir) if args.checkpoint_dir else None,
                   hosts=args.hosts, hostfile=args.hostfile, forward_env=args.forward_env,
                   mpiexec_args=args.mpiexec_args, memory_share=args.memory_share, restart_delay=args.restart_delay)
    if args.host_discovery_script:
        spec.elastic = ElasticSpec(os.path.abspath(args.host_discovery_script), args.min_np, args.max_np,
                                   start_np=args.np, slots_per_host=args.slots_per_host,
                                   timeout=args.elastic_timeout, cooldown=tuple(args.blacklist_cooldown_range))
    return Supervisor(spec).run()


if __name__ == "__main__":
    sys.exit(main())
