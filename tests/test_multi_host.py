"""shardrec-run across hosts: two network namespaces joined by a veth pair stand for two machines
(tests/netns_hosts.py), mpiexec reaching the second through an "ssh" that enters its namespace and
Open MPI's TCP kept on their link. The 2-host job must end as the single-host run does; a host
whose link is cut mid-run must be named and the job restarted, or the run must fail, never
succeed; a host that does not answer must be named."""
import json
import os
import re
import subprocess
import time

import psutil
import pytest

from elastic_helpers import assert_same_training, assert_saved_again, beat_step, rows_of, started
from netns_hosts import NetnsHosts
from shardrec.orchestrator.supervisor import latest_checkpoint
from supervisor_helpers import RUN, assert_gone, assert_same_final_state, attempt_pids, job_args, run_env, train
from waits import wait_for


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


def wait_for_checkpoint(ckpt, step, proc):
    """Until checkpoint `step` is complete (every rank's shard, the dense part, the listing)."""
    wait_for(lambda: (latest_checkpoint(str(ckpt))[1] or 0) >= step, proc, 120, f"checkpoint {step}")


def test_a_host_cut_off_mid_run_is_named_and_the_job_restarts_from_the_last_checkpoint(tmp_path, hosts,
                                                                                       uninterrupted):
    proc, out, run, ckpt = start_job(tmp_path, hosts, "cut", ("--hang-timeout", 10, "--max-restarts", 3,
                                                              "--restart-delay", 3))
    wait_for_checkpoint(ckpt, 10, proc)
    hosts.cut(1)
    # The supervisor notices, stops every process of the attempt, then waits 3 s before the restart:
    # the host comes back in that wait.
    first = attempt_pids(run, 0)
    wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                             for p in first), proc, 60, "the end of the first attempt")
    hosts.restore(1)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    assert re.search(rf"attempt 0 failed: host {hosts.names[1]} lost: no heartbeat from its rank\(s\) \[1\] for "
                     r"1\d s \(hang timeout 10 s\) while the other hosts' ranks still beat", stderr), stderr[-4000:]
    # How soon: the supervisor's own figure above (10-19 s of silence against a 10 s hang timeout).
    assert re.search(r"restarting the job in 3 s \(attempt 1 of 4\) from \S+model.ckpt-10 \(step 10\)", stderr)
    assert "attempt 1 failed" not in stderr, stderr[-4000:]
    assert_same_final_state(out, uninterrupted)


def test_when_mpiexec_exits_0_after_losing_a_host_the_run_fails_naming_it(tmp_path, hosts):
    """Open MPI 5 notices a lost daemon link by TCP keepalive (about 5 s with these settings) and
    then exits 0: the supervisor, with a hang timeout far longer, must still call it a failure."""
    keepalive = [f"--mpiexec-arg={a}" for a in ("--prtemca", "oob_tcp_keepalive_time", "2", "--prtemca",
                                                "oob_tcp_keepalive_intvl", "1", "--prtemca",
                                                "oob_tcp_keepalive_probes", "3")]
    proc, out, run, ckpt = start_job(tmp_path, hosts, "exit0", ("--hang-timeout", 300, "--max-restarts", 0,
                                                                 *keepalive))
    wait_for_checkpoint(ckpt, 10, proc)
    hosts.cut(1)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-4000:]
    assert re.search(rf"attempt 0 failed: mpiexec exited 0 but rank\(s\) \[0, 1\] never finished: host "
                     rf"{hosts.names[1]} \((rank 1\) fell silent first|rank\(s\) \[1\]\) was lost)", stderr), stderr[-4000:]
    assert_gone(attempt_pids(run, 0))


def test_a_host_that_does_not_answer_is_named_before_any_rank_starts(tmp_path, hosts):
    args, _, run = job_args(tmp_path, "unanswered", across(hosts, tmp_path, ("--max-restarts", 0),
                                                           hostfile_hosts=[hosts.names[0], hosts.names[2]]))
    proc = subprocess.run(hosts.inside(0, [RUN, *map(str, args)]), env=run_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert f"mpiexec could not start its daemon on host {hosts.names[2]}, or that host did not answer" in proc.stderr
    heard = os.listdir(run / "attempt-0" / "heartbeat") if (run / "attempt-0" / "heartbeat").is_dir() else []
    assert heard == [], heard  # no rank started


@pytest.fixture
def three_hosts(tmp_path):
    h = NetnsHosts(tmp_path / "hosts", linked=3)
    yield h
    h.close()


def test_an_elastic_job_goes_on_without_a_lost_host_and_grows_back_when_it_returns(tmp_path, hosts):
    """Two hosts, one rank each. Host 1 is killed for good (every process, its link, and the discovery
    script no longer lists it): the failure names rank 1 and host 1, and the job goes on with one
    rank from the last checkpoint, whose tables it restores exactly. Host 1 returns: the job grows
    back to two ranks at the end of a step, again exactly; each stretch is bitwise what a user
    restarting by hand on those ranks from the same checkpoint gets."""
    lose_a_host_and_get_it_back(tmp_path, hosts, 2)


def test_a_three_host_elastic_job_shrinks_to_two_and_grows_back_to_three(tmp_path, three_hosts):
    lose_a_host_and_get_it_back(tmp_path, three_hosts, 3)


def lose_a_host_and_get_it_back(tmp_path, hosts, n):
    """n hosts of one slot each; the last one is lost after checkpoint 10 and comes back."""
    names = hosts.names[:n]
    lost = names[-1]
    listing = tmp_path / "hosts-now"
    listing.write_text("".join(f"{h}\n" for h in names))
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    extra = ("--host-discovery-script", script, "--min-np", 1, "--max-np", n, "--blacklist-cooldown-range", 2, 10,
             "--hang-timeout", 20, *[f"--mpiexec-arg={x}" for x in hosts.mpiexec_args()])
    args, out, run = job_args(tmp_path, "elastic", extra)
    args[1] = n  # -np
    ckpt = tmp_path / "elastic-ckpt"
    proc = subprocess.Popen(hosts.inside(0, [RUN, *map(str, args)]), env=run_env(STEP_DELAY_S="0.4"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_checkpoint(ckpt, 10, proc)
        listing.write_text("".join(f"{h}\n" for h in names[:-1]))
        lost_at = time.monotonic()
        hosts.kill(n - 1)
        hosts.cut(n - 1)
        # The ranks left cannot complete another save without the lost one; on a busy machine the
        # job may have saved step 15 too before the loss. The smaller set resumes from the latest
        # and saves that step again: its rows as the full set wrote them are read first.
        saved = {step: rows_of(ckpt, f"model.ckpt-{step}") for step in complete_saves(ckpt, n)}
        wait_for(lambda: (run / "attempt-1" / "command.json").exists(), proc, 120, "the shrink")
        restored = int(started(run, 1)[2].rsplit("-", 1)[1])
        assert restored in saved, (restored, sorted(saved))
        wait_for(lambda: beat_step(run, 1) > restored, proc, 120, f"training on {n - 1} rank(s)")
        back_in = time.monotonic() - lost_at
        wait_for(lambda: sorted(os.listdir(ckpt / f"sparse-model.ckpt-{restored}")) ==
                 [f"rank-{r}-of-{n - 1}" for r in range(n - 1)], proc, 30, "the smaller set's save of the step restored")
        assert_saved_again(rows_of(ckpt, f"model.ckpt-{restored}"), saved[restored], restored)
        hosts.restore(n - 1)
        listing.write_text("".join(f"{h}\n" for h in names))
        returned_at = time.monotonic()
        wait_for(lambda: (run / "attempt-2" / "command.json").exists(), proc, 120, "the grow")
        grown_at = int(started(run, 2)[2].rsplit("-", 1)[1])
        name = f"model.ckpt-{grown_at}"
        saved_grow = rows_of(ckpt, name)
        assert sorted(os.listdir(ckpt / f"sparse-{name}")) == [f"rank-{r}-of-{n - 1}" for r in range(n - 1)]
        wait_for(lambda: beat_step(run, 2) > grown_at, proc, 120, f"training on {n} ranks again")
        full_in = time.monotonic() - returned_at
        assert sorted(os.listdir(ckpt / f"sparse-{name}")) == [f"rank-{r}-of-{n}" for r in range(n)]
        assert_saved_again(rows_of(ckpt, name), saved_grow, grown_at)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-5000:]
    everyone = list(range(n))
    assert (f"attempt 0 failed: mpiexec exited 0 but rank(s) {everyone} never finished: host {lost} (rank(s) "
            f"[{n - 1}]) was lost" in stderr), stderr[-5000:]
    assert f"host {lost} stays out of new attempts for 2 s" in stderr, stderr[-5000:]
    full, less = ",".join(f"{h}:1" for h in names), ",".join(f"{h}:1" for h in names[:-1])
    assert [started(run, k)[:2] for k in range(3)] == [(n, full), (n - 1, less), (n, full)]
    summary = json.loads((run / "summary.json").read_text())
    lost_steps = summary["attempt_list"][0]["steps_lost"]
    print(f"ELASTIC-TIMES {n} hosts: lost->training {back_in:.1f} s, returned->training on {n} {full_in:.1f} s, "
          f"steps lost {lost_steps}")
    assert_same_training(ckpt, tmp_path, restored, grown_at, out, ranks=(n - 1, n))


def complete_saves(ckpt, n):
    """The steps of the saves in `ckpt` that every one of `n` ranks committed."""
    steps = []
    for entry in os.listdir(ckpt):
        m = re.fullmatch(r"sparse-model\.ckpt-(\d+)", entry)
        if m and sorted(os.listdir(ckpt / entry)) == [f"rank-{r}-of-{n}" for r in range(n)] and \
                os.path.exists(ckpt / f"model.ckpt-{m.group(1)}.index"):
            steps.append(int(m.group(1)))
    return steps
