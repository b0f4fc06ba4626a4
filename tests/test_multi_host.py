"""shardrec-run across hosts: two network namespaces joined by a veth pair stand for two machines
(tests/netns_hosts.py), mpiexec reaching the second through an "ssh" that enters its namespace and
Open MPI's TCP kept on their link. The 2-host job must end as the single-host run does; a host
whose link is cut mid-run must be named and the job restarted, or the run must fail, never
succeed; a host that does not answer must be named."""
import re
import subprocess
import time

import psutil
import pytest

from netns_hosts import NetnsHosts
from shardrec.orchestrator.supervisor import latest_checkpoint
from supervisor_helpers import RUN, assert_gone, assert_same_final_state, attempt_pids, job_args, run_env, train


@pytest.fixture
def hosts(tmp_path):
    h = NetnsHosts(tmp_path / "hosts", unreachable=1)
    yield h
    h.close()


def across(hosts, tmp, extra=(), hostfile_hosts=None):
    """shardrec-run options for a 2-rank job with one rank on each linked host."""
    return ("--hostfile", hosts.hostfile(tmp, hostfile_hosts), *extra,
            *[f"--mpiexec-arg={a}" for a in hosts.mpiexec_args()])


def test_a_two_host_job_ends_as_the_single_host_run(tmp_path, hosts, uninterrupted):
    proc, out, run = train(tmp_path, "two-hosts", extra=across(hosts, tmp_path), prefix=hosts.inside(0, []))
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Each rank ran on its own host (the ranks' heartbeats carry their host name).
    beats = [(run / "attempt-0" / "heartbeat" / f"rank-{r}.json").read_text() for r in (0, 1)]
    assert [f'"host": "{hosts.names[r]}"' in beats[r] for r in (0, 1)] == [True, True], beats
    assert_same_final_state(out, uninterrupted)


def start_job(tmp, hosts, name, extra):
    args, out, run = job_args(tmp, name, across(hosts, tmp, extra))
    proc = subprocess.Popen(hosts.inside(0, [RUN, *map(str, args)]), env=run_env(STEP_DELAY_S="0.4"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out, run, tmp / f"{name}-ckpt"


def wait_for(done, proc, seconds, what):
    deadline = time.monotonic() + seconds
    while not done():
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        assert time.monotonic() < deadline, f"{what} did not happen in {seconds} s"
        time.sleep(0.1)


def wait_for_checkpoint(ckpt, step, proc):
    """Until checkpoint `step` is complete (every rank's shard, the dense part, the listing)."""
    wait_for(lambda: (latest_checkpoint(str(ckpt))[1] or 0) >= step, proc, 120, f"checkpoint {step}")


def test_a_host_cut_off_mid_run_is_named_and_the_job_restarts_from_the_last_checkpoint(tmp_path, hosts,
                                                                                       uninterrupted):
    proc, out, run, ckpt = start_job(tmp_path, hosts, "cut", ("--hang-timeout", 10, "--max-restarts", 3,
                                                              "--restart-delay", 3))
    wait_for_checkpoint(ckpt, 10, proc)
    cut_at = time.monotonic()
    hosts.cut(1)
    # The supervisor notices, stops every process of the attempt, then waits 3 s before the restart:
    # the host comes back in that wait.
    first = attempt_pids(run, 0)
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                             for p in first), proc, 60, "the end of the first attempt")
    stopped_in = time.monotonic() - cut_at
    hosts.restore(1)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    assert re.search(rf"attempt 0 failed: host {hosts.names[1]} lost: no heartbeat from its rank\(s\) \[1\] for "
                     r"1\d s \(hang timeout 10 s\) while the other hosts' ranks still beat", stderr), stderr[-4000:]
    assert stopped_in < 10 + 6, f"the lost host's attempt was stopped {stopped_in:.1f} s after its link went down"
    assert re.search(r"restarting the job in 3 s \(attempt 1 of 4\) from \S+model.ckpt-10 \(step 10\)", stderr)
    assert "attempt 1 failed" not in stderr, stderr[-4000:]
    assert_same_final_state(out, uninterrupted)


def test_when_mpiexec_exits_0_after_losing_a_host_the_run_fails_naming_it(tmp_path, hosts):
    """Open MPI 5 notices a lost daemon link by TCP keepalive (about 11 s with these settings) and
    then exits 0: the supervisor, with a hang timeout far longer, must still call it a failure."""
    keepalive = [f"--mpiexec-arg={a}" for a in ("--prtemca", "oob_tcp_keepalive_time", "5", "--prtemca",
                                                "oob_tcp_keepalive_intvl", "2", "--prtemca",
                                                "oob_tcp_keepalive_probes", "3")]
    proc, out, run, ckpt = start_job(tmp_path, hosts, "exit0", ("--hang-timeout", 300, "--max-restarts", 0,
                                                                 *keepalive))
    wait_for_checkpoint(ckpt, 10, proc)
    hosts.cut(1)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-4000:]
    assert re.search(rf"attempt 0 failed: mpiexec exited 0 but rank\(s\) \[0, 1\] never finished: host "
                     rf"{hosts.names[1]} \(rank 1\) fell silent first", stderr), stderr[-4000:]
    assert_gone(attempt_pids(run, 0))


def test_a_host_that_does_not_answer_is_named_before_any_rank_starts(tmp_path, hosts):
    args, _, run = job_args(tmp_path, "unanswered", across(hosts, tmp_path, ("--max-restarts", 0),
                                                           hostfile_hosts=[hosts.names[0], hosts.names[2]]))
    started = time.monotonic()
    proc = subprocess.run(hosts.inside(0, [RUN, *map(str, args)]), env=run_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert f"mpiexec could not start its daemon on host {hosts.names[2]}, or that host did not answer" in proc.stderr
    assert time.monotonic() - started < 60
