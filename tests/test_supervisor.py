"""shardrec-run and the supervisor under real mpiexec: a rank killed, failing or frozen mid-run is
detected, every process of the attempt is stopped, and the job restarts from the last complete
checkpoint and ends with the tables and weights of an uninterrupted run; bad input is refused
before anything starts."""
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from elastic_helpers import beat_step
from mpi_helpers import JOBS, segments_left_behind
from waits import wait_for
from shardrec.orchestrator.job_kill import segments_now as shm_segments_now
from shardrec.rank_runtime.formats.heartbeat_format import MARK, Heartbeat
from supervisor_helpers import (JOB, RUN, assert_gone, assert_same_final_state, attempt_pids, run_env, shardrec_run,
                                train)


def test_the_summary_sums_the_admission_counters_of_every_rank(tmp_path):
    sys.path.insert(0, JOBS)
    import supervised_train

    proc, _, run = train(tmp_path, "admission", env={"ACCESS_THRESHOLD": "2"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    ids = supervised_train.global_batches()[0]
    keys, counts = np.unique(ids, return_counts=True)
    admission = json.loads((run / "summary.json").read_text())["admission"]["emb"]
    assert admission["admitted"] == int((counts >= 2).sum())
    assert admission["pending"] == int((counts < 2).sum())
    assert admission["rejected"] > 0 and admission["evicted"] == 0
    assert "emb: admitted" in proc.stderr


def test_the_summary_sums_the_tier_counters_of_every_rank(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    proc, _, run = train(tmp_path, "tiers", env={"SSD_DIR": str(ssd)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    tiers = summary["tiers"]["emb"]
    assert tiers["rows_in_memory"] + tiers["rows_on_ssd"] == summary["tables"]["emb"]
    assert tiers["rows_on_ssd"] > 0 and tiers["swapped_out"] >= tiers["rows_on_ssd"]
    assert os.listdir(ssd) == [], "a clean shutdown leaves nothing under ssd_data_path"


def test_the_summary_has_every_rank_s_step_memory_and_the_tables_sizes(reference_run):
    proc, out, run = reference_run
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ok"] and summary["attempts"] == 1 and summary["restarts"] == 0
    keys = [np.load(out / f"final-rank{r}.npz")["keys"] for r in (0, 1)]
    assert summary["tables"] == {"emb": sum(len(k) for k in keys)}
    for rank in ("0", "1"):
        assert summary["ranks"][rank]["step"] == 30 and summary["ranks"][rank]["peak_rss"] > 100 * 2**20
        assert summary["ranks"][rank]["tables"] == {"emb": len(keys[int(rank)])}
    assert summary["checkpoints"][-1] == "model.ckpt-30"
    assert re.search(r"done: 1 attempt\(s\), 0 restart\(s\), .*tables emb \d+ keys", proc.stderr)
    # Read back through its types: the same values, and the same file written again.
    from shardrec.orchestrator import run_summary

    typed = run_summary.read(str(run))
    assert typed.ranks[1].step == 30 and typed.attempt_list[0].end.ok and typed.checkpoints == summary["checkpoints"]
    assert json.loads(json.dumps(typed.to_json())) == summary
    # Every rank passes 0.1% of the host's memory, and is reported once.
    for rank in (0, 1):
        assert len(re.findall(rf"rank {rank} on host \S+ uses [0-9.]+ GiB, over 0% of its host's [0-9.]+ GiB: the "
                              r"kernel may kill it", proc.stderr)) == 1


@pytest.mark.parametrize("fault,why", [("1:12:kill", r"rank 1 on host \S+ failed"), ("0:7:raise", r"rank 0 on host \S+ failed")],
                         ids=["sigkill", "exception"])
def test_a_failed_rank_restarts_from_the_last_checkpoint_and_ends_as_an_uninterrupted_run(
        tmp_path, uninterrupted, fault, why):
    proc, out, run = train(tmp_path, "faulty", fault=fault)
    assert proc.returncode == 0, proc.stderr[-4000:]
    step = 10 if fault.startswith("1:12") else 5
    assert re.search(rf"attempt 0 failed: {why}", proc.stderr), proc.stderr[-4000:]
    assert re.search(rf"restarting the job in 1 s \(attempt 1 of 4\) from \S+model.ckpt-{step} \(step {step}\)",
                     proc.stderr)
    assert f"DONE rank=0 step=30 resumed_from={step}" in proc.stdout  # rank 0's output reaches the terminal
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ok"] and summary["restarts"] == 1
    assert (run / "attempt-0" / "rank-1.log").exists() and (run / "attempt-1" / "rank-1.log").exists()
    assert_same_final_state(out, uninterrupted)
    assert_gone(attempt_pids(run, 0))


def test_a_frozen_rank_is_detected_as_hung_and_no_process_of_its_attempt_survives(tmp_path, uninterrupted):
    before = shm_segments_now()
    proc, out, run = train(tmp_path, "frozen", fault="1:8:stop", extra=("--hang-timeout", 10))
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The killed attempt's mpiexec could not remove its ranks' shared memory; the supervisor did.
    assert re.search(r"attempt 0: removed 2 shared-memory segment\(s\) its killed ranks left in /dev/shm", proc.stderr)
    assert not segments_left_behind(before), "a segment of the job is left in /dev/shm"
    assert re.search(r"attempt 0 failed: rank 1 on host \S+ sent no heartbeat for [0-9]+ s \(hang timeout 10 s\); its "
                     r"process is stopped", proc.stderr), proc.stderr[-4000:]
    assert_gone(attempt_pids(run, 0))
    # Before killing, the supervisor asked the rank that still ticked for its stack.
    assert "(most recent call first)" in (run / "attempt-0" / "rank-0.log").read_text()
    assert re.search(r"the stacks of rank\(s\) \[0(, 1)?\] at that moment are in their logs", proc.stderr)
    assert_same_final_state(out, uninterrupted)


def test_without_restarts_a_failing_rank_ends_the_run_naming_it_with_its_last_lines(tmp_path):
    proc, _, run = train(tmp_path, "once", fault="1:4:raise", extra=("--max-restarts", 0))
    assert proc.returncode == 1
    assert f"attempt 0 failed: rank 1 on host {socket.gethostname()} failed" in proc.stderr
    assert "last lines of rank 1" in proc.stderr and "injected failure on rank 1 at step 4" in proc.stderr
    assert "giving up after 1 attempt(s) (--max-restarts 0); the last complete checkpoint is" in proc.stderr
    assert not json.loads((run / "summary.json").read_text())["ok"]


@pytest.mark.parametrize("args,message", [
    (["-np", "0", "python", "x.py"], "-np 0: the number of ranks must be at least 1"),
    (["-np", "2", "python", "no_such_script.py"], "'no_such_script.py': no such script"),
    (["-np", "2", "no-such-program-here"], "'no-such-program-here': no such program"),
    (["-np", "2", "--max-restarts", "-1", "python", "x.py"], "--max-restarts -1: allowed: 0 (never restart) or more"),
    (["-np", "2", "--hostfile", "/nonexistent/hosts", "python", "x.py"], "--hostfile /nonexistent/hosts: cannot be read"),
    (["-np", "2"], "no COMMAND"),
    (["-np", "2", "--restart-delay", "-1", "python", "x.py"], "--restart-delay -1.0: allowed: 0 to 3600 seconds"),
    (["-np", "2", "-H", "localhost:1,no-such-host.invalid:1", "python", "x.py"],
     "host 'no-such-host.invalid' (-H): its name does not resolve"),
], ids=["np0", "missing_script", "missing_program", "negative_restarts", "hostfile", "no_command",
        "negative_delay", "unknown_host"])
def test_bad_input_is_refused_before_anything_starts(tmp_path, args, message):
    (tmp_path / "x.py").write_text("")
    proc = shardrec_run("--run-dir", tmp_path / "run", *args, timeout=30, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists(), "nothing started"


def _supervised(tmp_path, env, ready, what):
    """The test job under shardrec-run on 2 ranks, once ready(run directory) holds; returns (the
    supervisor's process, its stderr file, the checkpoint, output and run directories)."""
    ckpt, out, run, err = tmp_path / "ckpt", tmp_path / "out", tmp_path / "run", tmp_path / "supervisor.err"
    out.mkdir()
    with open(err, "w") as stderr:
        proc = subprocess.Popen([RUN, "-np", "2", "--checkpoint-dir", ckpt, "--run-dir", run, "--hang-timeout", "600",
                                 "--", sys.executable, JOB, ckpt, out], env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    wait_for(lambda: ready(run), proc, 120, what)
    return proc, err, ckpt, out, run


def _rank_stopped(run, rank):
    """Whether the rank (its pid from its beats) is stopped (SIGSTOP)."""
    import psutil

    directory = run / "attempt-0" / "heartbeat"
    try:
        pid = json.loads((directory / f"rank-{rank}.json").read_text())["pid"]
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except (OSError, ValueError, KeyError, psutil.NoSuchProcess):
        return False


def test_a_second_sigterm_stops_every_rank_at_once_and_says_where_the_last_checkpoint_is(tmp_path):
    """Rank 1 freezes: the first SIGTERM's request to save and stop cannot be met (and the job would
    not end by itself before the hang timeout); the second stops every process."""
    import signal

    proc, err, _, _, run = _supervised(tmp_path, run_env(fault="1:12:stop"),
                                       lambda run: (tmp_path / "ckpt" / "checkpoint").exists() and _rank_stopped(run, 1),
                                       "a checkpoint, then rank 1 frozen")
    proc.send_signal(signal.SIGTERM)
    said = "signal 15: every rank finishes its step, saves and stops (within 120 s; a second signal stops them at once)"
    wait_for(lambda: said in err.read_text(), proc, 60, "the first SIGTERM's stop request")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    stderr = err.read_text()
    assert proc.returncode == 130, stderr[-3000:]
    assert re.search(r"stopped: interrupted by signal 15; every rank is stopped; the last complete checkpoint is "
                     r"\S+model.ckpt-\d+ \(step \d+\)", stderr), stderr[-3000:]
    assert_gone(attempt_pids(run, 0))


def test_sigterm_makes_every_rank_finish_its_step_save_and_exit_0(tmp_path):
    """The job (a step every 0.3 s) gets one SIGTERM once every rank passed step 5: its ranks end their
    input at the same batch, the script saves that step when its loop ends, and the supervisor exits 0
    naming the checkpoint."""
    import signal

    proc, err, _, out, run = _supervised(tmp_path, run_env(STEP_DELAY_S="0.3"),
                                         lambda run: min(beat_step(run, 0, r) for r in (0, 1)) >= 5,
                                         "step 5 on both ranks")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    stderr = err.read_text()
    assert proc.returncode == 0, stderr[-3000:]
    found = re.search(r"stopped: asked to by signal 15; every rank saved and exited at step (\d+); the last complete "
                      r"checkpoint is \S+model.ckpt-(\d+) \(step (\d+)\)", stderr)
    assert found and found[1] == found[2] == found[3] and 5 <= int(found[1]) < 30, stderr[-3000:]
    steps = [int(np.load(out / f"final-rank{r}.npz")["step"]) for r in (0, 1)]
    assert steps == [int(found[1])] * 2
    assert json.loads((run / "summary.json").read_text())["ok"]
    assert_gone(attempt_pids(run, 0))


def final_checkpoint(model_dir):
    """{key: row} of table 'emb' and the dense weight of the job's final checkpoint (step 30)."""
    from shardrec.orchestrator import checkpoints

    found = {c.step: c for c in checkpoints.find_checkpoints(str(model_dir))}
    rows = checkpoints.table_rows(found[30], "emb")
    w = tf.train.load_checkpoint(str(model_dir / "model.ckpt-30")).get_tensor("w")
    return dict(zip(rows["keys"].tolist(), rows["values"])), w


def test_an_estimator_job_resumes_by_itself_after_a_rank_is_killed(tmp_path):
    job = os.path.join(JOBS, "supervised_estimator.py")
    runs = {}
    for name, fault in (("reference", None), ("killed", "1:12:kill")):
        model_dir = tmp_path / f"{name}-model"
        proc = shardrec_run("-np", 2, "--checkpoint-dir", model_dir, "--run-dir", tmp_path / f"{name}-run",
                            "--restart-delay", 1, "--", sys.executable, job, model_dir, fault=fault)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = (proc, final_checkpoint(model_dir))
    killed = runs["killed"][0].stderr
    assert f"attempt 0 failed: rank 1 on host {socket.gethostname()} failed (killed by signal 9" in killed, killed[-3000:]
    assert re.search(r"restarting the job in 1 s \(attempt 1 of 4\) from \S+model.ckpt-10 \(step 10\)", killed)
    (want_rows, want_w), (got_rows, got_w) = runs["reference"][1], runs["killed"][1]
    assert sorted(got_rows) == sorted(want_rows)
    for key, row in want_rows.items():
        np.testing.assert_allclose(got_rows[key], row, atol=1e-5, err_msg=f"key {key}")
    np.testing.assert_allclose(got_w, want_w, atol=1e-5)


def _attempt(tmp_path, np, beats, started=1000.0, usable_hosts=None, **spec):
    """An attempt of `np` ranks started at `started` that heard `beats`, (rank, Heartbeat, time) each
    in order, as its output reader records them (a beat of unchanged progress is a tick)."""
    from shardrec.orchestrator.attempt import Attempt
    from shardrec.orchestrator.job_spec import JobSpec

    attempt = Attempt(JobSpec(command=["true"], np=np, run_dir=str(tmp_path), **spec), 0, None, None,
                      usable_hosts=usable_hosts)
    attempt.started = started
    for rank, beat, at in beats:
        attempt.record_beat(rank, beat, at)
    return attempt


def test_the_progress_line_has_a_bar_step_speed_loss_and_eta_on_a_terminal(tmp_path, capsys):
    import time

    now = time.monotonic()
    attempt = _attempt(tmp_path, 2, [(0, Heartbeat(step=15, total_steps=30, samples_per_s=1234.4, loss=0.25), now)],
                       started=now - 10)
    attempt.progress_line(tty=True)
    line = capsys.readouterr().err
    assert re.fullmatch(r"\r\[shardrec-run\] attempt 0 on 2 rank\(s\)  \[##########\.{10}\]  step 15/30  1234 samples/s  "
                        r"loss 0\.2500  ETA (9|10) s\x1b\[K", line), repr(line)
    attempt.progress_line(tty=False)  # not a terminal: a plain log line, no bar
    plain = capsys.readouterr().err
    assert re.search(r"\] attempt 0 on 2 rank\(s\)  step 15/30  1234 samples/s  loss 0\.2500  ETA (9|10) s\n$", plain), plain


def test_ranks_still_finishing_after_one_exited_get_a_grace_but_silence_counts_at_once(tmp_path):
    """Closing a session and tearing MPI / Horovod down over TCP can take seconds once a peer has
    exited (seen in the 2-host test: 10 s in Session.close): that is not a hang until the grace ends."""
    from shardrec.orchestrator.attempt import FINISH_GRACE_S

    now, a = 1000.0, Heartbeat(host="a")
    started = [(0, Heartbeat(host="a", exiting=True), now), (1, a, now), (2, a, now)]
    attempt = _attempt(tmp_path, 3, started + [(1, a, now + 25), (2, a, now + 25)], hang_timeout=10)
    assert attempt.hung(now + 25) == (None, None, None)  # 25 s without progress, still ticking, rank 0 done
    for rank in (1, 2):
        attempt.record_beat(rank, a, now + FINISH_GRACE_S)
    why, rank, _ = attempt.hung(now + FINISH_GRACE_S + 1)
    assert rank in (1, 2) and f"did not finish within {FINISH_GRACE_S + 1:.0f} s of its last progress, while rank(s) " \
                              "[0] had exited" in why
    # Rank 2 fell silent: counted at the hang timeout, grace or not.
    attempt = _attempt(tmp_path, 3, started + [(2, a, now + 5), (1, a, now + 16)], hang_timeout=10)
    why, rank, _ = attempt.hung(now + 16)
    assert rank == 2 and why.startswith("rank 2 on host a sent no heartbeat for 11 s (hang timeout 10 s)")


def test_a_job_whose_stream_has_no_new_data_is_waiting_not_hung_but_silence_counts(tmp_path):
    """A rank whose stream has nothing new says so in its beats; it and the ranks waiting for it in
    the key exchange make no progress by design. A silent rank is still hung at the hang timeout."""
    now, waiting, a = 1000.0, Heartbeat(host="a", waiting_for_data=True), Heartbeat(host="a")

    def ticking(rank0, last1=now + 99):
        return _attempt(tmp_path, 2, [(0, rank0, now), (1, a, now), (0, rank0, now + 99), (1, a, last1)],
                        hang_timeout=10)

    assert ticking(waiting).hung(now + 100) == (None, None, None)  # 100 s without progress, both ticking
    why, rank, _ = ticking(a).hung(now + 100)  # data again, and still no progress: stalled
    assert rank in (0, 1) and "made no progress for 100 s (hang timeout 10 s)" in why, why
    why, rank, _ = ticking(waiting, last1=now + 80).hung(now + 100)
    assert rank == 1 and why.startswith("rank 1 on host a sent no heartbeat for 20 s (hang timeout 10 s)"), why


def test_a_rank_still_starting_gets_the_start_grace_before_it_counts_as_hung(tmp_path):
    """Before its first heartbeat a rank is importing TensorFlow and joining MPI, which a busy
    machine can make longer than a short hang timeout (seen with two test files side by side):
    silence counts from START_GRACE_S then; once heard from, the hang timeout applies to silence.
    Before its first progress (a restore, the first collective while a peer restores: a restarted
    attempt in the cut-host test stalled 10 s there) no progress counts from START_GRACE_S too."""
    from shardrec.orchestrator.attempt import START_GRACE_S

    now, a = 1000.0, Heartbeat(host="a")
    attempt = _attempt(tmp_path, 2, [(0, a, now + 29)], hang_timeout=10)
    assert attempt.hung(now + 30) == (None, None, None)  # rank 1 silent 30 s since the start: still starting
    why, rank, _ = attempt.hung(now + START_GRACE_S + 1)
    assert rank == 1 and why.startswith(f"rank 1 sent no heartbeat for {START_GRACE_S + 1:.0f} s"), why
    attempt.record_beat(1, a, now + 30)
    attempt.record_beat(0, Heartbeat(host="a", progress=1), now + 40)
    why, rank, _ = attempt.hung(now + 41)
    assert rank == 1 and why.startswith("rank 1 on host a sent no heartbeat for 11 s (hang timeout 10 s)"), why
    # Both beat, neither has made progress yet (restoring, waiting for the other in the first
    # collective): starting until START_GRACE_S; then, still ticking, stalled.
    ticking = [(r, a, now + t) for t in (0, 20, 40, START_GRACE_S, START_GRACE_S + 5) for r in (0, 1)]
    attempt = _attempt(tmp_path, 2, ticking[:6], hang_timeout=10)
    assert attempt.hung(now + 41) == (None, None, None)  # 41 s without progress, heard 1 s ago
    attempt = _attempt(tmp_path, 2, ticking, hang_timeout=10)
    why, rank, _ = attempt.hung(now + START_GRACE_S + 6)
    assert rank in (0, 1) and f"made no progress for {START_GRACE_S + 6:.0f} s (hang timeout 10 s)" in why, why

# Both as Open MPI 5.0's mpiexec printed them in this project's two-host tests: which one comes
# depends on whether PRRTE first sees the daemon's ssh exit or its TCP link break.
_DAEMON_NEVER_REPORTED = """A daemon failed to report back after being spawned. This could
be due to several factors, including inability to find the
daemon executable, or the executable was unable to find its
required supporting libraries. In some cases, the daemon was
able to execute, but was unable to complete a TCP connection
back to prterun:

  Local host:    sr6523a
  Remote host:   sr6523b
  Daemon exit status: 0
"""
_DAEMON_LOST = """PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-sr4381a-4407@0,0] on node sr4381a
  Remote daemon: [prterun-sr4381a-4407@0,1] on node sr4381b

This is usually due to either a failure of the TCP network
"""


@pytest.mark.parametrize("text, host", [(_DAEMON_NEVER_REPORTED, "sr6523b"), (_DAEMON_LOST, "sr4381b"),
                                        ("rank 1 exited on signal 9 (Killed)", None)])
def test_the_host_mpiexec_lost_is_read_from_either_of_its_messages(text, host):
    from shardrec.orchestrator.mpiexec_output import lost_daemon_host
    assert lost_daemon_host("[rank 0/2] step 10\n" + text) == host


def test_an_elastic_job_blames_the_host_its_discovery_no_longer_lists_when_silences_tie(tmp_path):
    """mpiexec exited 0 naming no host: the rank silent longest is blamed, but silences within a
    heartbeat tick are a tie, so an elastic job blames first the ranks on a host that discovery no
    longer lists, even when the surviving host's rank was silent a little longer."""

    def ended(usable_hosts):
        now = 1000.0
        attempt = _attempt(tmp_path, 2, [(0, Heartbeat(rank=0, size=2, host="host-a"), now - 1.2),
                                         (1, Heartbeat(rank=1, size=2, host="host-b"), now - 0.9)],
                           usable_hosts=usable_hosts)
        return attempt.judge_end(0, now)

    without = ended(None)
    assert (without.rank, without.host, without.host_lost) == (0, "host-a", True), without
    listed = ended(lambda: {"host-a"})
    assert (listed.rank, listed.host, listed.host_lost) == (1, "host-b", True), listed
    assert "host host-b (rank 1) fell silent first" in listed.reason, listed.reason


# Open MPI's TCP transport on a surviving rank when its peer's connection breaks (help-mpi-btl-tcp.txt,
# "peer hung up"), tagged as that rank's stderr: what came first when host b's processes were all
# SIGKILLed and its link cut, before either of PRRTE's messages.
_PEER_HUNG_UP = """An MPI communication peer process has unexpectedly disconnected.  This
usually indicates a failure in the peer process (e.g., a crash or
otherwise exiting without calling MPI_FINALIZE first).

  Local host: a
  Local PID:  4211
  Peer host:  b
"""


def _ended_attempt(tmp_path, code, rank_lines, launcher="", usable_hosts=None, silent_for=(0.5, 0.5)):
    """Attempt.judge_end(code) of a two-rank, two-host attempt (rank 0 on a, rank 1 on b) whose ranks
    printed rank_lines (rank -> text) and mpiexec printed `launcher`."""
    from shardrec.orchestrator.mpiexec_output import LAUNCHER

    now = 1000.0
    attempt = _attempt(tmp_path, 2, [(0, Heartbeat(rank=0, size=2, host="a"), now - silent_for[0]),
                                     (1, Heartbeat(rank=1, size=2, host="b"), now - silent_for[1])],
                       usable_hosts=usable_hosts)
    for rank, text in [*rank_lines.items(), (LAUNCHER, launcher)]:
        for line in text.splitlines():
            attempt.record_line(rank, line)
    return attempt.judge_end(code, now)


@pytest.mark.parametrize("usable", [None, lambda: {"a"}])
def test_a_host_lost_is_named_when_a_peer_s_transport_error_comes_first(tmp_path, usable):
    """No PRRTE message, no rank's own word: rank 0's transport names its peer's host, and (elastic)
    discovery has dropped it. The failure names rank 1 and host b, lost, and says how it knows."""
    out = _ended_attempt(tmp_path, 14, {0: "[rank 0/2] step 12\n" + _PEER_HUNG_UP}, usable_hosts=usable)
    assert (out.ok, out.ranks, out.host, out.host_lost) == (False, [1], "b", True), out
    assert out.reason.startswith("host b lost, with rank(s) [1]: rank(s) [0]'s MPI transport lost its peer there"), out
    assert ("discovery script no longer lists it" in out.reason) == (usable is not None), out.reason
    assert "mpiexec exited 14" in out.reason


def test_a_host_lost_is_named_from_discovery_and_silence_alone(tmp_path):
    """Nothing in the output names a host: discovery dropped b and b's rank fell silent first."""
    out = _ended_attempt(tmp_path, 14, {0: "[rank 0/2] step 12"}, usable_hosts=lambda: {"a"}, silent_for=(0.1, 30))
    assert (out.ranks, out.host, out.host_lost) == ([1], "b", True), out
    assert "discovery script no longer lists it; its rank(s) fell silent" in out.reason, out.reason


def test_a_rank_that_failed_by_itself_is_blamed_not_the_host_its_peers_complain_of(tmp_path):
    """Rank 1 raised (its exit hook says so) and its peer's transport complains of b: rank 1 failed,
    host b is not lost; nor when mpiexec saw rank 1 die of a signal."""
    own = _ended_attempt(tmp_path, 1, {0: _PEER_HUNG_UP, 1: "[rank 1/2] uncaught error, ending the whole job "
                                                         "(MPI_Abort, status 1): ValueError: bad"})
    assert (own.ranks, own.host, own.host_lost) == ([1], "b", False), own
    assert own.reason.startswith("rank 1 on host b failed"), own.reason
    signalled = _ended_attempt(tmp_path, 137, {0: _PEER_HUNG_UP}, launcher="prterun noticed that process rank 1 with "
                               "PID 77 on node b exited on\nsignal 9 (Killed).")
    assert (signalled.ranks, signalled.host, signalled.host_lost) == ([1], "b", False), signalled
    assert "killed by signal 9 (Killed)" in signalled.reason


def test_the_summary_names_the_lost_host_and_its_ranks(tmp_path):
    from shardrec.orchestrator.job_spec import JobSpec
    from shardrec.orchestrator.supervisor import Supervisor

    outcome = _ended_attempt(tmp_path, 14, {0: _PEER_HUNG_UP})
    sup = Supervisor(JobSpec(command=["true"], np=2, run_dir=str(tmp_path)))
    sup.write_summary(0.0, outcome)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["lost_host"], summary["failed_ranks"], summary["ok"]) == ("b", [1], False), summary
    assert summary["reason"] == outcome.reason


def test_a_restart_from_the_start_says_why_the_checkpoints_it_found_are_not_complete(reference_run, tmp_path):
    """why_none, the reason a restart line gives for going back to step 0: nothing for no
    checkpoint; the newest one's problems when none is complete; when one is complete by the time
    it looks again (a rank still wrote there), that one."""
    import shutil

    from shardrec.orchestrator.supervisor import why_none

    assert why_none(str(tmp_path / "absent")) == ""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference_run[1].parent / "ref-ckpt", ckpt)
    newest = max((p for p in os.listdir(ckpt) if p.startswith("sparse-")), key=lambda p: int(p.rsplit("-", 1)[1]))
    assert why_none(str(ckpt)) == f"; a second look finds {newest[len('sparse-'):]} complete"
    for meta in ckpt.glob("*.meta"):
        meta.unlink()
    why = why_none(str(ckpt))
    count = sum(1 for p in os.listdir(ckpt) if p.startswith("sparse-"))
    assert why.startswith(f"; {count} incomplete, the newest {newest[len('sparse-'):]}: "), why
    assert f"{newest[len('sparse-'):]}.meta: missing" in why, why


def test_no_heartbeat_follows_the_last_one(tmp_path):
    """The exit beat is a rank's last: the ticker, still running while the process exits, writes
    nothing after it. A process ticking every 10 ms ends once four beats came (its stdin closes), and
    exits for 0.5 s more: 50 ticks that must not come (a negative has a window, not an event)."""
    script = ("import atexit, sys, time\n"
              "atexit.register(time.sleep, 0.5)  # runs after the heartbeat's last beat (at-exit runs LIFO)\n"
              "from shardrec.rank_runtime.process import heartbeat\nheartbeat.start(0, 1)\nsys.stdin.read()\n")
    env = {**os.environ, "SHARDREC_RUN_DIR": str(tmp_path), "SHARDREC_HEARTBEAT_INTERVAL_S": "0.01"}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines = []
    try:
        while sum(MARK in line for line in lines) < 4:  # ticks before the exit
            line = proc.stderr.readline()
            assert line, "".join(lines)  # the process ended before it ticked
            lines.append(line)
        proc.stdin.close()
        lines += proc.stderr.readlines()
        assert proc.wait(timeout=120) == 0, "".join(lines)
    except BaseException:
        proc.kill()
        raise
    beats = [Heartbeat.parse(line.split(MARK, 1)[1]) for line in lines if MARK in line]
    assert len(beats) > 3, "".join(lines)
    assert [b.exiting for b in beats].index(True) == len(beats) - 1, [b.exiting for b in beats]
