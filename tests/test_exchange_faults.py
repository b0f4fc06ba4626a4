"""What one rank decides, every rank learns in the same round; no collective waits for ever. Each
case runs tests/mpi_jobs/exchange_faults.py under a real mpiexec with 2 ranks."""
import os
import re
import sys

import numpy as np
import pytest

from mpi_helpers import JOBS, check, mpiexec
from supervisor_helpers import shardrec_run

JOB = "exchange_faults.py"


def results(proc):
    return dict(re.findall(r"RESULT rank=(\d) (.*)", proc.stdout))


def errors(proc):
    return dict(re.findall(r"ERROR rank=(\d): (.*)", proc.stdout))


def test_a_caught_overflow_stops_the_channel_on_every_rank_in_step():
    proc = check(mpiexec(2, JOB, "caught_overflow", timeout=120))
    # Batches 0 and 1 train; batch 2 overflows on rank 1 only; every later batch raises on both.
    assert results(proc) == {"0": "ok=2 errors=5 first_error_batch=2", "1": "ok=2 errors=5 first_error_batch=2"}
    for rank, message in errors(proc).items():
        assert "feature 'ids' of table 't': rank 1 has 16 unique keys for rank 0, more than send_count=4; " \
               "raise send_count to at least 16" in message, (rank, message)
    assert len(errors(proc)) == 2


def test_a_full_table_is_raised_on_every_rank_in_the_same_round():
    proc = check(mpiexec(2, JOB, "full_table", timeout=120))
    assert results(proc) == {"0": "ok=2 errors=5 first_error_batch=2", "1": "ok=2 errors=5 first_error_batch=2"}
    assert len(errors(proc)) == 2
    for message in errors(proc).values():
        assert "table 't' is full on rank 0 (10 rows per rank, reached by feature 'ids'); raise the table's " \
               "device_vocabulary_size" in message
        assert "eviction" not in message


def test_feature_specs_listed_in_another_order_are_matched_by_name():
    proc = check(mpiexec(2, JOB, "order", timeout=120))
    held = {(r, t): sorted(map(int, keys.split(","))) for r, t, keys in
            re.findall(r"HELD rank=(\d) table=(\w+) keys=([\d,]+)", proc.stdout)}
    ids = {}
    for rank in (0, 1):
        rng = np.random.default_rng(rank)
        ids.setdefault("ta", set()).update(rng.integers(0, 50, size=(32, 2)).ravel().tolist())
        ids.setdefault("tb", set()).update(rng.integers(1000, 1050, size=(32, 3)).ravel().tolist())
    for rank in (0, 1):
        for table in ("ta", "tb"):
            assert held[(str(rank), table)] == sorted(k for k in ids[table] if k % 2 == rank), (rank, table)


def test_ranks_whose_tables_differ_stop_naming_the_first_difference():
    proc = check(mpiexec(2, JOB, "dim_mismatch", timeout=120))
    assert results(proc) == {"0": "ok=0 errors=5 first_error_batch=0", "1": "ok=0 errors=5 first_error_batch=0"}
    for message in errors(proc).values():
        # b's dim 8 on rank 1 leaves a alone there, where rank 0 groups a with b: the first entry differs.
        assert ("differ at entry 1: rank 0 has feature 'a' (table 'ta', dim 4, key dtype int64, send_count dynamic, "
                "no admission, row_wise, lookup group 'a'), rank 1 has feature 'a' (table 'ta', dim 4,") in message


# Each job below would hang for ever without what it tests: mpiexec's timeout bounds it, and the
# outcome is what the ranks say, never how long they took.
def test_an_evaluation_on_one_rank_times_out_naming_the_channel_and_the_missing_rank():
    proc = mpiexec(2, JOB, "eval_one_rank", timeout=120, env={"SHARDREC_EXCHANGE_TIMEOUT_S": "4"})
    assert proc.returncode != 0
    message = errors(proc)["0"]
    assert "key exchange 'eval' (rank 0 of 2), status round: rank(s) 1 did not arrive within 4 s" in message
    assert "[rank 0/2] uncaught error, ending the whole job" in proc.stderr


def test_a_non_zero_exit_on_one_rank_ends_the_job_at_once_naming_rank_and_status():
    proc = mpiexec(2, JOB, "exit_status", timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "[rank 1/2] exiting with status 3, ending the whole job (MPI_Abort, status 3)" in proc.stderr
    assert "MPI_ABORT was invoked on rank 1" in proc.stderr


@pytest.mark.parametrize("mode,status,what", [
    ("raise_before_init", 1, "uncaught error (RuntimeError: rank 1 fails before init())"),
    ("exit_before_init", 5, "exiting with status 5")])
def test_a_rank_that_fails_before_mpi_started_ends_the_job_through_mpi_abort(mode, status, what):
    """Leaving the ending to mpiexec hung Open MPI 5.0's launcher now and then (rank 0 connecting to
    it as it ended the job): the failing rank starts MPI, which returns once rank 0 has too, and
    aborts. Run three times: each run meets the race at most once."""
    for _ in range(3):
        proc = mpiexec(2, JOB, mode, timeout=120)
        assert proc.returncode == status, proc.stderr[-3000:]
        assert (f"[rank 1/2] {what} before MPI started; starting MPI to end the whole job once every rank has "
                f"started it (MPI_Abort, status {status};") in proc.stderr
        assert "MPI_ABORT was invoked on rank 1" in proc.stderr


def test_a_rank_that_fails_before_mpi_started_leaves_a_peer_that_never_starts_it_to_mpiexec():
    """Rank 0 sleeps before init(): rank 1 waits SHARDREC_EXIT_TIMEOUT_S in MPI's start, then exits
    and mpiexec ends the job (rank 0 waiting, not connecting)."""
    proc = mpiexec(2, JOB, "raise_before_slow_init", timeout=90, env={"SHARDREC_EXIT_TIMEOUT_S": "5"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert ("(MPI_Abort, status 1; after 5 s, SHARDREC_EXIT_TIMEOUT_S, this rank writes its stack and exits with "
            "status 1, and mpiexec ends the job)") in proc.stderr
    assert "Timeout (0:00:05)!" in proc.stderr and "_abort_through_mpi" in proc.stderr
    assert "RESULT rank=0" not in proc.stdout


@pytest.mark.parametrize("mode,status", [("mpi_raise_before_init", "FileNotFoundError"),
                                         ("mpi_exit_before_init", "exiting with status 4")])
def test_a_rank_that_fails_before_init_after_starting_mpi_itself_ends_the_job_in_seconds(mode, status):
    """The peer is inside init()'s first collective, and the failing rank's own MPI_Finalize would
    wait for it: without the exit hooks of the import, the job never ended (mpiexec's timeout)."""
    proc = mpiexec(2, JOB, mode, timeout=120)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "MPI_ABORT was invoked on rank 1" in proc.stderr
    assert re.search(r"\[rank 1/2\] (uncaught error|exiting with status 4), ending the whole job", proc.stderr)
    assert status in proc.stderr


@pytest.mark.parametrize("mode", ["mpi_raise_before_init", "raise_before_init"])
def test_a_supervised_rank_that_fails_before_init_is_named_by_the_supervisor(mode, tmp_path):
    proc = shardrec_run("-np", 2, "--max-restarts", 0, "--run-dir", tmp_path / "run", "--",
                        sys.executable, os.path.join(JOBS, JOB), mode, timeout=120)
    assert proc.returncode != 0
    assert "attempt 0 failed: rank 1 failed (status 1)" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]


@pytest.mark.parametrize("ranks", [2, 3])
def test_an_evaluation_after_a_rank_left_fails_on_every_rank_that_runs_it(ranks, tmp_path):
    """Rank 1 trains with the others, then exits; the evaluation pass of the ranks still there must
    not report success over 0 batches (or over their own shards' rows alone)."""
    proc = mpiexec(ranks, JOB, "eval_after_exit", timeout=120, env={"RENDEZVOUS_DIR": str(tmp_path)})
    assert proc.returncode != 0
    evaluating = [r for r in range(ranks) if r != 1]
    assert "evaluated" not in proc.stdout
    messages = errors(proc)
    assert sorted(messages) == [str(r) for r in evaluating], proc.stdout[-3000:] + proc.stderr[-3000:]
    # Rank 1 closed its session (then left): the first word the others' evaluation meets says so.
    for rank in evaluating:
        assert (f"key exchange 'eval' (rank {rank} of {ranks}): rank(s) 1 closed their session before beginning "
                "this round (batch 1 of the channel)") in messages[str(rank)]
    assert "every rank must run the same passes, each on its own shard of the data" in proc.stderr


def test_a_rank_without_data_is_named_in_a_warning_on_every_rank():
    proc = check(mpiexec(2, JOB, "empty_rank", timeout=120))
    assert results(proc) == {"0": "ok=0 errors=0 first_error_batch=None", "1": "ok=0 errors=0 first_error_batch=None"}
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}/2\] .* WARNING shardrec.pipeline: train data: rank\(s\) \[1\] had no batch "
                         r"at all in this pass", proc.stderr)


def test_a_step_on_one_rank_only_ends_naming_the_rank_missing_from_the_row_exchange():
    proc = mpiexec(2, JOB, "step_one_rank", timeout=150, env={"SHARDREC_EXCHANGE_TIMEOUT_S": "5"})
    assert proc.returncode != 0
    assert results(proc).get("1") == "skipped the step"
    # The lookup's row exchange names the rank that did not join it, within the exchange timeout.
    assert "DeadlineExceededError" in proc.stderr
    assert re.search(r"row exchange 't/ids/train#0' \(rank 0 of 2\), rows: rank\(s\) 1 did "
                     r"not send theirs within 5 s \(SHARDREC_EXCHANGE_TIMEOUT_S\)", proc.stderr), proc.stderr[-3000:]


def test_ranks_that_disagree_on_a_row_exchange_s_counts_both_stop_naming_the_peer():
    proc = check(mpiexec(2, JOB, "row_splits_disagree", timeout=120))
    found = errors(proc)
    assert found.get("0", "").startswith("row exchange 't/ids/train#0' (rank 0 of 2), rows: rank 1 sent 2 values, "
                                         "this rank expected 4"), proc.stdout
    assert re.match(r"row exchange 't/ids/train#0' \(rank 1 of 2\), rows: rank 0 sent more than the 2 values this "
                    r"rank expected \(MPI_ERR_TRUNCATE", found.get("1", "")), proc.stdout


def test_ranks_that_stop_before_their_data_ends_exit_without_waiting_for_each_other():
    # Without rank 1 telling its peers at exit, rank 0 closed its session only after the exchange
    # timeout, here far past mpiexec's: that the job ends at all is the outcome.
    proc = check(mpiexec(2, JOB, "stop_early", timeout=300, env={"SHARDREC_EXCHANGE_TIMEOUT_S": "3600"}))
    assert results(proc) == {"0": "closed", "1": "closed"}


def test_a_second_session_of_the_graph_trains_its_whole_pass_after_a_step_limited_one():
    """The first session stops after 3 of 40 steps with the ranks' prefetches at different rounds;
    its close words must neither end nor shift the rounds of the next session on the same graph."""
    proc = check(mpiexec(2, JOB, "stop_and_resume", timeout=180))
    assert results(proc) == {"0": "ok=40 errors=0 first_error_batch=None",
                             "1": "ok=40 errors=0 first_error_batch=None"}, proc.stdout + proc.stderr[-3000:]


def test_ranks_that_built_different_lookups_stop_at_the_pipeline_start_naming_the_difference():
    # Tables alone: in a table group a second lookup of a feature reads the first one's rows.
    proc = mpiexec(2, JOB, "extra_lookup", timeout=120, env={"SHARDREC_TABLE_GROUPS": "off"})
    assert proc.returncode != 0
    errors = re.findall(r"ERROR rank=(\d): (.*)", proc.stdout)
    assert errors, proc.stderr[-3000:]
    for _, message in errors:
        assert re.search(r"the ranks built different lookups \(first difference: 't/ids/train#1( gradients)?'\); "
                         r"every rank must build the same sparse_lookup calls", message), message
