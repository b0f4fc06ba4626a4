"""A job restarted on another number of ranks (issue 29): its checkpoints stay whole.

A restart on fewer ranks restores the last checkpoint resharded; MonitoredTrainingSession's hook
then saves that step again at once, by the new world size. That save must replace every shard of
the step, whatever world size wrote them, and a save killed half way must leave the step as it was.
"""
import os
import subprocess
import sys

import json
import re

import pytest

from elastic_helpers import (assert_bitwise_same, assert_rows_equal, assert_same_training, assert_saved_again,
                             beat_step, by_hand, discovery, elastic_args, rows_of, started, stopped_at_the_end)
from mpi_helpers import check, kill_during_save, mpiexec
from waits import wait_for

RUN_CKPT = os.path.join(os.path.dirname(sys.executable), "shardrec-ckpt")


def inspect(directory):
    return subprocess.run([RUN_CKPT, "inspect", str(directory)], capture_output=True, text=True)


def test_the_hook_saving_a_restored_step_again_on_fewer_ranks_replaces_every_shard(tmp_path):
    """2 ranks save step 5 and die at step 7; 1 rank restores step 5 (its MonitoredTrainingSession
    saves step 5 again at once) and dies at step 6. Step 5 holds the 1-rank shard alone, equals
    what 2 ranks saved, and restores; later saves by 2 ranks again replace the 1-rank ones."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    job = ("supervised_train.py", ckpt, out)
    proc = mpiexec(2, *job, env={"FAULT": "1:7:kill"}, timeout=240)
    assert proc.returncode != 0 and "FAULT rank=1 step=7 kill" in proc.stdout, proc.stdout[-3000:]
    assert sorted(os.listdir(ckpt / "sparse-model.ckpt-5")) == ["rank-0-of-2", "rank-1-of-2"]
    saved_by_two = rows_of(ckpt, "model.ckpt-5")

    proc = mpiexec(1, *job, env={"FAULT": "0:6:kill"}, timeout=240)
    assert proc.returncode != 0 and "FAULT rank=0 step=6 kill" in proc.stdout, proc.stdout[-3000:]
    assert sorted(os.listdir(ckpt / "sparse-model.ckpt-5")) == ["rank-0-of-1"]
    assert not [e for e in os.listdir(ckpt) if e.endswith(".saving")]
    assert_saved_again(rows_of(ckpt, "model.ckpt-5"), saved_by_two, 5)  # resharded exactly, slots too
    report = inspect(ckpt)
    assert report.returncode == 0 and "model.ckpt-5: step 5, world size 1, OK" in report.stdout, report.stdout

    # 2 ranks again, from step 5 to the end: each save replaces the 1-rank one of its step, and
    # max_to_keep removes old ones whole, whichever world size wrote them.
    check(mpiexec(2, *job, timeout=240))
    for entry in os.listdir(ckpt):
        if entry.startswith("sparse-"):
            assert sorted(os.listdir(ckpt / entry)) == ["rank-0-of-2", "rank-1-of-2"], entry
    assert inspect(ckpt).returncode == 0


def test_a_save_killed_while_replacing_a_step_of_another_world_size_leaves_the_old_one(tmp_path):
    """1 rank restores a 2-rank checkpoint of step 10 and saves step 10 again; killed while it
    writes, the 2-rank checkpoint is intact and restores; shardrec-ckpt names the unfinished save."""
    job = "ckpt_job.py"
    big = ["--dim", "64", "--vocab", "1200000"]
    check(mpiexec(2, job, "--out", tmp_path, "--tag", "before", "--start", 0, "--end", 10, "--save",
                  tmp_path / "model", *big, timeout=300))
    saved = rows_of(tmp_path, "model-10")
    kill_during_save(1, job, ["--out", tmp_path, "--tag", "killed", "--start", 10, "--end", 10, "--restore",
                              tmp_path / "model-10", "--save", tmp_path / "model", "--extra-keys", 500000, *big],
                     tmp_path / "sparse-model-10")
    assert sorted(os.listdir(tmp_path / "sparse-model-10")) == ["rank-0-of-2", "rank-1-of-2"]
    assert_rows_equal(rows_of(tmp_path, "model-10"), saved)
    report = inspect(tmp_path)
    assert report.returncode == 0, report.stdout + report.stderr
    assert ".sparse-model-10.saving: the shards of a save that did not finish" in report.stdout, report.stdout
    # The next save of the step, by 1 rank, replaces it whole and removes the leftover.
    check(mpiexec(1, job, "--out", tmp_path, "--tag", "again", "--start", 10, "--end", 10, "--restore",
                  tmp_path / "model-10", "--save", tmp_path / "model", *big, timeout=300))
    assert sorted(os.listdir(tmp_path / "sparse-model-10")) == ["rank-0-of-1"]
    assert not (tmp_path / ".sparse-model-10.saving").exists()
    assert_rows_equal(rows_of(tmp_path, "model-10"), saved)


def test_inspect_reports_a_directory_of_two_world_sizes(tmp_path):
    """Shards of two world sizes in one step's directory (left by an older shardrec): inspect says
    which, and the checkpoint is not taken for complete."""
    job = "ckpt_job.py"
    check(mpiexec(2, job, "--out", tmp_path, "--tag", "two", "--start", 0, "--end", 3, "--save", tmp_path / "model"))
    check(mpiexec(1, job, "--out", tmp_path / "one", "--tag", "one", "--start", 0, "--end", 3, "--save",
                  tmp_path / "one" / "model"))
    os.rename(tmp_path / "one" / "sparse-model-3" / "rank-0-of-1", tmp_path / "sparse-model-3" / "rank-0-of-1")
    report = inspect(tmp_path)
    assert report.returncode == 1, report.stdout
    assert ("shards of different world sizes: 1 rank(s): rank-0-of-1; 2 rank(s): rank-0-of-2, rank-1-of-2"
            in report.stdout), report.stdout


def test_restoring_a_model_directory_names_the_checkpoints_it_holds(tmp_path):
    job = "ckpt_job.py"
    check(mpiexec(1, job, "--out", tmp_path, "--tag", "a", "--start", 0, "--end", 3, "--save", tmp_path / "model"))
    proc = mpiexec(1, job, "--out", tmp_path, "--tag", "b", "--restore", tmp_path, "--catch-restore")
    text = proc.stdout + proc.stderr
    assert f"{tmp_path} is a directory, not a checkpoint prefix: it holds the checkpoint(s) model-3" in text, text[-3000:]
    assert "tf.train.latest_checkpoint(" in text


# shardrec-run --host-discovery-script: the job shrinks onto the slots left and grows back.

@pytest.mark.parametrize("tables", ["memory", "admission-eviction-ssd"])
def test_a_job_shrinks_onto_the_slots_left_and_grows_back_exactly(tmp_path, tables):
    """2 slots, then rank 1 dies at step 12 while discovery says 1 slot: the job goes on with 1 rank
    from checkpoint 10; 2 slots again: the ranks save and stop, and the job ends on 2. Each stretch
    is bitwise what a user gets restarting by hand on those ranks from the same checkpoint; with
    admission, eviction and an SSD tier, admission counts, timestamps and every tier's rows too.
    In memory the planner places the table (init(sharding_plan="auto")), again at every attempt:
    replicated on 2 ranks, row-wise on 1, replicated again after the grow."""
    env = {"SHARDING_PLAN": "auto"}
    if tables == "admission-eviction-ssd":
        (tmp_path / "ssd").mkdir()
        env = {"ACCESS_THRESHOLD": "2", "EVICT_AFTER": "4", "SSD_DIR": str(tmp_path / "ssd")}
    script, listing = discovery(tmp_path, "localhost:2\n")
    proc, out, run = start_elastic(tmp_path, "elastic", "1:12:kill", elastic_args(script), env=env)
    with stopped_at_the_end(proc):
        wait_for(lambda: beat_step(run, 0) >= 8, proc, 240, "step 8")
        listing.write_text("localhost:1\n")  # one slot from now on, until the job runs on it
        wait_for(lambda: beat_step(run, 1) >= 13, proc, 240, "step 13 of attempt 1")
        listing.write_text("localhost:2\n")
        _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-5000:]
    assert started(run, 0)[:2] == (2, "localhost:2")
    np1, hosts1, resumed1 = started(run, 1)
    assert (np1, hosts1) == (1, "localhost:1") and resumed1.endswith("model.ckpt-10"), stderr[-4000:]
    np2, hosts2, resumed2 = started(run, 2)
    assert (np2, hosts2) == (2, "localhost:2")
    grown_at = int(resumed2.rsplit("-", 1)[1])
    assert 13 <= grown_at < 30, stderr[-4000:]
    assert re.search(r"attempt 0 failed: rank 1 on host \S+ failed", stderr), stderr[-4000:]
    assert "growing from 1 to 2 rank(s) (2 slot(s) usable now: localhost (2))" in stderr, stderr[-4000:]
    assert f"attempt 1 saved and stopped at step {grown_at} to grow" in stderr, stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ok"] and [a["np"] for a in summary["attempt_list"]] == [2, 1, 2]
    assert summary["attempt_list"][1]["reason"] == "resized" and summary["attempt_list"][1]["steps_lost"] == 0
    # Steps lost: those past checkpoint 10 that the ranks' last beats reported (beats come at most
    # twice a second, so the last step or two before the kill may not have been heard).
    first = summary["attempt_list"][0]
    assert first["reached_step"] in (10, 11, 12) and first["steps_lost"] == first["reached_step"] - 10, first
    lost = re.findall(r"(\d+) step\(s\) lost: the ranks had reached step (\d+), the next attempt resumes from step 10",
                      stderr)
    # Said exactly when steps were lost (a kill heard right after the save loses none).
    assert lost == ([(str(first["steps_lost"]), str(first["reached_step"]))] if first["steps_lost"] else []), lost
    if "SSD_DIR" in env:
        got = rows_of(tmp_path / "elastic-ckpt", f"model.ckpt-{grown_at}")
        assert {"counts", "last_seen", "pending_keys"} <= set(got) and got["counts"].min() >= 2, sorted(got)
        summary_tiers = summary.get("tiers", {}).get("emb", {})
        assert summary_tiers, summary  # the SSD tier was in use
        assert summary["admission"]["emb"]["evicted"] > 0, summary  # keys unseen for 4 steps went
        assert 0 <= got["last_seen"].min() and got["last_seen"].max() < 30, got["last_seen"]  # steps, not wall time
    if "SHARDING_PLAN" in env:  # the planner placed the table again at each attempt, for its world
        for attempt, placement in ((0, "replicated"), (1, "row_wise"), (2, "replicated")):
            log = (run / f"attempt-{attempt}" / "rank-0.log").read_text()
            assert re.search(rf"\nemb +{placement} .* planner", log), log[-3000:]
    assert_same_training(tmp_path / "elastic-ckpt", tmp_path, 10, grown_at, out, env)


def test_a_script_that_does_not_save_when_its_loop_ends_grows_from_its_last_checkpoint(tmp_path):
    """A grow asked of a loop that saves on a schedule only (here: at its start, step 0): the ranks
    stop as asked, the supervisor names the steps trained again and resumes from that checkpoint on
    the larger set, and the end equals a user's run on 2 ranks from the same checkpoint."""
    env = {"NO_FINAL_SAVE": "1", "SAVE_STEPS": "1000"}
    script, listing = discovery(tmp_path, "localhost:1\n")
    proc, out, run = start_elastic(tmp_path, "elastic", None, elastic_args(script), env=env, np=1)
    with stopped_at_the_end(proc):
        wait_for(lambda: beat_step(run, 0) >= 4, proc, 240, "step 4")
        listing.write_text("localhost:2\n")
        _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-5000:]
    assert [started(run, k)[:2] for k in range(2)] == [(1, "localhost:1"), (2, "localhost:2")]
    assert started(run, 1)[2].endswith("model.ckpt-0"), stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    first = summary["attempt_list"][0]
    assert first["reason"] == "resized" and first["reached_step"] >= 4, first
    assert first["steps_lost"] == first["reached_step"], first
    assert (f"{first['steps_lost']} step(s) lost: the ranks had reached step {first['reached_step']}, the next "
            "attempt resumes from step 0") in stderr, stderr[-4000:]
    assert (f"attempt 0 stopped without a checkpoint of its last step at step {first['reached_step']} to grow "
            f"(2 slot(s) usable now: localhost (2)); resuming from ") in stderr, stderr[-4000:]
    _, hand_out = by_hand(tmp_path, "hand", tmp_path / "elastic-ckpt", 0, 2, 30, env)
    assert_bitwise_same(out, hand_out, range(2))


def test_the_first_attempt_waits_for_np_slots_then_later_ones_for_min_np(tmp_path):
    """horovodrun's rule: -np slots to start with (-np 2 here, 1 slot listed: no rank starts, and
    after --elastic-timeout the job fails saying so), --min-np to go on with after a failure."""
    script, listing = discovery(tmp_path, "localhost:1\n")
    proc, _, run = start_elastic(tmp_path, "short", None, elastic_args(script, "--elastic-timeout", 3))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-4000:]
    assert ("giving up: fewer than -np 2 (to start with) slot(s) usable for 3 s (--elastic-timeout); usable now: "
            "localhost (1)") in stderr, stderr[-4000:]
    assert not (run / "attempt-0").exists()
    # The second slot comes while the job waits: it starts on both.
    proc, out, run = start_elastic(tmp_path, "waits", None, elastic_args(script), step_delay="0")
    with stopped_at_the_end(proc):
        said = "1 slot(s) usable (localhost (1)), fewer than -np 2 (to start with); waiting up to 600 s"
        wait_for(lambda: (run / "hosts.log").exists() and said in (run / "hosts.log").read_text(), proc, 240, said)
        assert not (run / "attempt-0").exists()
        listing.write_text("localhost:2\n")
        _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-4000:]
    assert started(run, 0)[:2] == (2, "localhost:2") and not (run / "attempt-1").exists()


def start_elastic(tmp, name, fault, extra, step_delay="0.4", env=None, np=2):
    from supervisor_helpers import RUN, job_args, run_env

    args, out, run = job_args(tmp, name, extra)
    args[1] = np
    proc = subprocess.Popen([RUN, *map(str, args)], env=run_env(fault, STEP_DELAY_S=step_delay, **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, out, run


def test_below_min_np_for_longer_than_the_elastic_timeout_the_job_fails_naming_the_hosts_lost(tmp_path):
    from supervisor_helpers import assert_gone, attempt_pids

    script, listing = discovery(tmp_path, "localhost:2\n")
    proc, _, run = start_elastic(tmp_path, "starved", "1:6:kill", elastic_args(script, "--elastic-timeout", 4))
    with stopped_at_the_end(proc):
        wait_for(lambda: beat_step(run, 0) >= 2, proc, 240, "step 2")
        listing.write_text("")  # the host goes as rank 1 dies
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-4000:]
    assert ("giving up: fewer than --min-np 1 slot(s) usable for 4 s (--elastic-timeout); hosts lost: localhost; "
            "usable now: none") in stderr, stderr[-4000:]
    assert "0 slot(s) usable (no host), fewer than --min-np 1; waiting up to 4 s (--elastic-timeout)" in stderr
    assert not (run / "attempt-1").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert not summary["ok"] and "hosts lost: localhost" in summary["reason"]
    assert_gone(attempt_pids(run, 0))


def test_a_discovery_script_that_fails_hangs_or_prints_garbage_is_named_and_the_hosts_kept(tmp_path):
    script, _ = discovery(tmp_path, "localhost:2\n")
    mode = tmp_path / "mode"
    proc, out, run = start_elastic(tmp_path, "flaky", None, elastic_args(script), step_delay="0.5")
    with stopped_at_the_end(proc):
        wait_for(lambda: beat_step(run, 0) >= 2, proc, 240, "step 2")
        for what, said in (("fail", "exit status 3: inventory down"),
                           ("garbage", "line 1 'not a host!' is not `host` or `host:slots` (slots >= 1)"),
                           ("hang", "no answer in 10 s")):
            mode.write_text(what)
            # 120 s: this VM's host stalls it for up to 90 s now and then (the kernel's "workqueue lockup").
            wait_for(lambda: (run / "hosts.log").exists() and said in (run / "hosts.log").read_text(), proc, 120, said)
        mode.write_text("")
        _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-4000:]
    for said in ("exit status 3: inventory down", "is not `host` or `host:slots`", "no answer in 10 s"):
        assert f"host discovery script {script}: " in stderr and said in stderr, stderr[-4000:]
    assert "keeping the hosts known before (localhost:2)" in stderr
    assert not (run / "attempt-1").exists()  # the job ran on 2 ranks throughout


@pytest.mark.parametrize("extra,message", [
    (("--min-np", 3), "--min-np 3: allowed: 1 to -np (2)"),
    (("--max-np", 1), "--max-np 1: allowed: -np (2) or more"),
    (("--blacklist-cooldown-range", 9, 3), "--blacklist-cooldown-range 9 3: allowed: 0 <= LOW <= HIGH seconds"),
    (("--elastic-timeout", 0), "--elastic-timeout 0.0: allowed: a number of seconds > 0"),
], ids=["min-np", "max-np", "cooldown", "timeout"])
def test_bad_elastic_options_are_refused_before_anything_starts(tmp_path, extra, message):
    from supervisor_helpers import shardrec_run

    script, _ = discovery(tmp_path, "localhost:2\n")
    proc = shardrec_run("-np", 2, "--host-discovery-script", script, "--checkpoint-dir", tmp_path / "c", *extra,
                        "--run-dir", tmp_path / "run", "--", sys.executable, "-c", "pass")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_discovery_script_that_is_not_executable_or_elastic_options_without_one_are_refused(tmp_path):
    from supervisor_helpers import shardrec_run

    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    common = ("--checkpoint-dir", tmp_path / "c", "--", sys.executable, "-c", "pass")
    proc = shardrec_run("-np", 2, "--host-discovery-script", script, *common)
    assert proc.returncode == 2 and f"--host-discovery-script {script}: not an executable file" in proc.stderr
    proc = shardrec_run("-np", 2, "--min-np", 1, *common)
    assert proc.returncode == 2 and "--min-np needs --host-discovery-script" in proc.stderr, proc.stderr
    script.chmod(0o755)
    proc = shardrec_run("-np", 2, "--host-discovery-script", script, "--", sys.executable, "-c", "pass")
    assert proc.returncode == 2 and "--host-discovery-script needs --checkpoint-dir" in proc.stderr, proc.stderr


def test_hosts_parse_cool_down_and_place():
    from shardrec.orchestrator.hosts import Cooldowns, DiscoveryError, Host, parse_hosts, place

    assert parse_hosts("# comment\na:2\nb\n\nc:1\n", 4, "s") == [Host("a", 2), Host("b", 4), Host("c", 1)]
    for bad in ("a:0", "a b", "a:x", "a:2:3"):
        with pytest.raises(DiscoveryError, match="is not `host` or `host:slots`"):
            parse_hosts(bad, 1, "s")
    cool = Cooldowns(10, 30)
    assert [cool.failed("a", now=0) for _ in range(3)] == [10, 20, 30]
    assert cool.cooling(now=29) == {"a": 1} and cool.cooling(now=31) == {}
    placement = place([Host("a", 2), Host("b", 2), Host("c", 2)], {"b": 5.0}, 3)
    assert placement.mpiexec_hosts() == "a:2,c:1" and placement.np == 3
    assert [placement.host_of_rank(r) for r in range(4)] == ["a", "a", "c", None]
