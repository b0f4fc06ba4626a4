"""Sharding across ranks under real mpiexec: N-rank training reproduces 1-rank training, each rank
holds exactly its keys, uneven data stops every rank together, errors stop every rank."""
import glob
import os
import re
import sys

import numpy as np
import pytest

from mpi_helpers import check, mpiexec

pytestmark = pytest.mark.quick

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def oracle_runs(tmp_path_factory):
    out = {}
    for n, modes in ((1, "div"), (2, "div,sum"), (4, "div,sum")):
        d = tmp_path_factory.mktemp(f"oracle{n}")
        check(mpiexec(n, "oracle_train.py", d, modes))
        out.update({(n, mode): d for mode in modes.split(",")})
    return out


def load(directory, opt, n, mode="div"):
    parts = [np.load(os.path.join(directory, f"{mode}-{opt}-rank{r}-of{n}.npz")) for r in range(n)]
    assert len(glob.glob(os.path.join(directory, f"{mode}-{opt}-rank*-of{n}.npz"))) == n
    return parts


@pytest.mark.parametrize("opt", ["sgd", "lazy_adam"])
@pytest.mark.parametrize("n,mode", [(2, "div"), (4, "div"), (2, "sum"), (4, "sum")])
def test_n_ranks_reproduce_one_rank(oracle_runs, opt, n, mode):
    [ref] = load(oracle_runs[1, "div"], opt, 1)
    ref_rows = dict(zip(ref["keys"].tolist(), ref["rows"]))
    assert max(np.abs(r - 0.1).max() for r in ref_rows.values()) > 0.05, "training moved the rows"
    rows = {}
    for part in load(oracle_runs[n, mode], opt, n, mode):
        assert int(part["steps"]) == int(ref["steps"]) == 40
        np.testing.assert_allclose(part["w"], ref["w"], atol=1e-5, rtol=0)
        rows.update(zip(part["keys"].tolist(), part["rows"]))
    assert rows.keys() == ref_rows.keys()
    for key, row in ref_rows.items():
        np.testing.assert_allclose(rows[key], row, atol=1e-5, rtol=0, err_msg=f"key {key}")


@pytest.mark.parametrize("n", [2, 4])
def test_each_rank_holds_exactly_its_residue(oracle_runs, n):
    sys.path.insert(0, os.path.join(ROOT, "tests", "mpi_jobs"))
    import oracle_train

    all_keys = set(np.unique(oracle_train.global_data()["ids"]).tolist())
    for rank, part in enumerate(load(oracle_runs[n, "div"], "sgd", n)):
        held = part["keys"].tolist()
        assert len(held) == len(set(held)) == int(part["local_size"])
        assert set(held) == {k for k in all_keys if k % n == rank}
        assert int(part["global_size"]) == len(all_keys)


def test_uneven_data_stops_every_rank_at_the_same_step():
    """The ranks learn of the end in the exchange's status round, not from its timeout (600 s, far
    past mpiexec's here)."""
    proc = check(mpiexec(3, "uneven_data.py", timeout=120))
    stops = re.findall(r"STOP rank=(\d) pass=(\w+) steps=(\d+) seconds=([0-9.]+)", proc.stdout)
    assert len(stops) == 9, proc.stdout
    for rank, name, steps, _ in stops:
        # Rank 0 has the fewest batches: 6 for training, 2 for evaluation.
        assert int(steps) == (6 if name == "train" else 2), stops
    assert "train data: another rank ran out after 6 batches (rank(s) [0] ran out)" in proc.stderr
    assert "[rank 0/3]" in proc.stderr and "this rank has no more" in proc.stderr


def test_send_count_overflow_stops_every_rank_with_the_named_error():
    proc = mpiexec(2, "send_count_overflow.py", timeout=120)
    assert proc.returncode != 0
    for rank in (0, 1):
        assert re.search(rf"ERROR rank={rank}: .*table 'narrow': rank 1 has 16 unique keys for rank 0, "
                         r"more than send_count=4", proc.stdout), proc.stdout + proc.stderr[-3000:]
    assert "NO ERROR" not in proc.stdout


def test_global_size_sums_ranks_and_a_lone_caller_times_out():
    proc = check(mpiexec(2, "global_size.py", timeout=120))
    assert re.findall(r"SIZES rank=\d local=(\d+) global=(\d+)", proc.stdout) == [("40", "80")] * 2
    assert re.search(r"LONE rank=1: table 't': global_size\(\): not every rank called it within 2 s", proc.stdout)
    # Where each rank was: rank 1's own stacks, and SIGUSR1 to rank 0 (in its exit by then, where
    # the signal is ignored rather than ending it: the job exited 0 above).
    assert "global_size(): timed out; the stacks of this rank and of rank(s) [0] on this host follow" in proc.stderr
    assert re.search(r"most recent call first\):\n(  File .*\n)*  File .*global_size.py\", line 30", proc.stderr), \
        proc.stderr[-3000:]


@pytest.mark.parametrize("feed", ["memory", "parquet"])
def test_demo_trains_on_two_ranks(tmp_path, feed):
    """The demo from its in-memory samples, and from the same samples written as Parquet files
    (--parquet): there every row of the files is trained once, as the checkpoint's positions say."""
    parquet = ["--parquet", tmp_path / "parquet"] if feed == "parquet" else []
    proc = check(mpiexec(2, os.path.join(ROOT, "examples", "wide_deep.py"), "--steps", "200", "--eval-samples", "10000",
                         "--model-dir", tmp_path / "model", *parquet))
    if feed == "parquet":
        import pyarrow.parquet as pq

        from shardrec.rank_runtime.formats.sparse_checkpoint import read_manifest

        files = sorted(os.listdir(tmp_path / "parquet"))
        assert files == ["part-00000-of-00002.parquet", "part-00001-of-00002.parquet"], files
        rows = sum(pq.ParquetFile(tmp_path / "parquet" / f).metadata.num_rows for f in files)
        assert rows == 2 * 200 * 512
        sparse = tmp_path / "model" / "sparse-model-200"
        positions = [pos for shard in os.listdir(sparse) if shard.startswith("rank-")
                     for pos in read_manifest(str(sparse / shard)).stream.partitions.values()]
        assert len(positions) == 2 and sum(p.offset for p in positions) == rows, positions
        # A later run that would draw other samples is refused, naming the file, before it trains.
        other = mpiexec(2, os.path.join(ROOT, "examples", "wide_deep.py"), "--steps", "100", "--model-dir",
                        tmp_path / "other", *parquet)
        assert other.returncode != 0 and "part-0000" in other.stderr and \
            "use another directory, or the same settings" in other.stderr, other.stderr[-3000:]
    summaries = re.findall(r"SUMMARY rank=(\d)/2 .*eval_auc=([0-9.]+) .*deep_table=(\d+)/(\d+)", proc.stdout)
    assert sorted(s[0] for s in summaries) == ["0", "1"], proc.stdout
    from test_demo import EMBEDDING_MARGIN, dense_only_auc

    for rank, auc, local, total in summaries:
        assert float(auc) >= dense_only_auc(int(rank), 10000) + EMBEDDING_MARGIN
        assert 0 < int(local) < int(total)
    assert sum(int(s[2]) for s in summaries) == int(summaries[0][3])


def test_a_job_that_hangs_says_where_every_rank_is():
    """What a test (or a user with `kill -USR1`) gets from ranks that hang after init(): each rank's
    Python stacks, not a bare timeout."""
    with pytest.raises(AssertionError) as failure:
        mpiexec(2, "stuck_after_init.py", timeout=20)
    text = str(failure.value)
    assert "still running after 20 s" in text
    stacks = re.findall(r'File ".*stuck_after_init.py", line \d+ in waiting_for_ever_after_init', text)
    assert len(stacks) == 2, text[-3000:]


def test_an_exit_that_waits_says_what_for_after_5_s_and_is_bounded():
    """A script that ends leaving a thread of its own that never ends: Python's exit would wait for
    it for ever. Each rank says, 5 s into its exit, where its main thread waits and which thread
    still runs; at SHARDREC_EXIT_TIMEOUT_S the job ends with an error naming the rank and the wait."""
    proc = mpiexec(2, "slow_exit.py", timeout=120, env={"SHARDREC_EXIT_TIMEOUT_S": "12"})
    assert proc.returncode != 0 and proc.stdout.count("SCRIPT-DONE") == 2, proc.stderr[-3000:]
    waits = "Python's join of the script's own threads (threads not made daemon=True)"
    said = re.findall(rf"\[rank (\d)/2\] .* exiting for (\d+) s now; the main thread waits in {re.escape(waits)}; "
                      r"other threads: ([^(]*) \(", proc.stderr)
    assert said and {r for r, *_ in said} <= {"0", "1"}, proc.stderr[-3000:]
    assert all(int(s) >= 5 and "a-thread-that-never-ends" in others for _, s, others in said), said
    assert re.search(rf"\[rank \d/2\] exiting took 1[2-9] s \(SHARDREC_EXIT_TIMEOUT_S\), waiting in {re.escape(waits)}; "
                     r"other threads: a-thread-that-never-ends; .*ending the whole job \(MPI_Abort, status 1\)",
                     proc.stderr), proc.stderr[-3000:]


def test_a_script_run_without_mpiexec_leaves_no_shared_memory_behind(tmp_path):
    """A process alone in its MPI job (no mpiexec: MPI's singleton) has no daemon to remove its
    16 MiB segment in /dev/shm when it ends; init() removes its name at once. Killed or not, the
    segment it maps is gone."""
    import json
    import signal
    import subprocess

    script = tmp_path / "alone.py"
    script.write_text("import json, sys, time\nimport tensorflow as tf\ntf.compat.v1.disable_eager_execution()\n"
                      "from shardrec.rank_runtime import init\ninit()\n"
                      "maps = open('/proc/self/maps').read().splitlines()\n"
                      "print('SEGMENTS', json.dumps(sorted({l.split(maxsplit=5)[-1] for l in maps "
                      "if '/dev/shm/sm_segment' in l})), flush=True)\ntime.sleep(60 if sys.argv[1] == 'wait' else 0)\n")

    def segments(line):
        assert line.startswith("SEGMENTS "), line
        mapped = json.loads(line[len("SEGMENTS "):])
        assert len(mapped) == 1 and mapped[0].endswith(" (deleted)"), mapped
        return mapped[0][: -len(" (deleted)")]

    done = check(subprocess.run([sys.executable, str(script), "exit"], capture_output=True, text=True, timeout=120))
    assert not os.path.exists(segments(done.stdout.strip().splitlines()[-1]))
    proc = subprocess.Popen([sys.executable, str(script), "wait"], stdout=subprocess.PIPE, text=True)
    path = segments(proc.stdout.readline().strip())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(path)
