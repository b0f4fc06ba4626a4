"""ParquetDataset in real jobs: exactly once through a kill, a kill inside a save and a resize
2 -> 1 -> 2 under shardrec-run, against the files' own rows and an uninterrupted run."""
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tensorflow as tf

from mpi_helpers import JOBS, check, mpiexec
from shardrec.orchestrator.checkpoints import find_checkpoints
from stream_helpers import FIELDS, counted

PARTITIONS, FILES, GROUPS, GROUP_ROWS = 4, 4, 5, 24


def write_files(directory, seed=0):
    """FILES files of GROUPS row groups of GROUP_ROWS rows ({"ids": FIELDS ids, "y"}); returns the
    ids of every row group in the order ParquetDataset deals them (file by file)."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 2**40, size=200)
    groups = []
    os.makedirs(directory)
    for f in range(FILES):
        ids = pool[np.minimum(rng.geometric(0.03, size=(GROUPS * GROUP_ROWS, FIELDS)) - 1, len(pool) - 1)]
        y = rng.normal(size=len(ids)).astype(np.float32)
        table = pa.table({"ids": pa.FixedSizeListArray.from_arrays(pa.array(ids.reshape(-1)), FIELDS), "y": y})
        pq.write_table(table, os.path.join(directory, f"part-{f}.parquet"), row_group_size=GROUP_ROWS)
        groups += np.split(ids, GROUPS)
    return groups


def trained_ids(groups, positions):
    """The ids of the rows before each partition's position (row g goes to partition g % PARTITIONS,
    in order; no shuffle): what the checkpoint trained."""
    taken = [np.concatenate(groups[int(p)::PARTITIONS])[:pos.offset] for p, pos in positions.items()]
    return np.concatenate(taken)


def _sorted_rows(model):
    from shardrec.orchestrator.checkpoints import table_rows

    [ckpt] = find_checkpoints(tf.train.latest_checkpoint(str(model)))
    rows = table_rows(ckpt, "emb")
    order = np.argsort(rows["keys"])
    return {name: rows[name][order] for name in ("keys", "values", "counts")}


def test_a_parquet_job_trains_every_row_once_through_a_kill_a_kill_in_a_save_and_a_resize(tmp_path):
    """Under shardrec-run with a discovery script, 2 ranks read 4 files (20 row groups, 4
    partitions). Rank 1 is SIGKILLed after step 7 while one slot is left: the job goes on on 1 rank
    from checkpoint 5. Two slots again: it saves, stops and goes on on 2. Rank 1 is SIGKILLed
    inside its save of step 20 (arrays written, manifest not): the job goes on from the last
    complete save, and then to the files' end. The final checkpoint's admission counts are exactly the occurrences of
    every key in the rows before its positions, which leave fewer rows than a batch a rank; its
    table equals, bit for bit (SGD), that of the same rows trained on as many ranks for the same
    steps without a fault."""
    from elastic_helpers import beat_step, discovery, elastic_args, started, stopped_at_the_end
    from supervisor_helpers import RUN, run_env
    from waits import wait_for

    data, model, out, run = tmp_path / "data", tmp_path / "model", tmp_path / "out", tmp_path / "run"
    groups = write_files(data)
    out.mkdir()
    script, listing = discovery(tmp_path, "localhost:2\n")
    job = ["--parquet", "--stream", data, "--partitions", PARTITIONS, "--out", out, "--every", 5,
           "--access-threshold", 3, "--optimizer", "sgd"]
    cmd = [RUN, "-np", 2, "--checkpoint-dir", model, "--run-dir", run, "--restart-delay", 1, *elastic_args(script),
           "--", sys.executable, os.path.join(JOBS, "stream_job.py"), *job, "--tag", "end", "--model", model,
           "--die-at", 7, "--die-in-save", 20, "--die-in-save-attempt", 2, "--step-delay", 0.3]
    proc = subprocess.Popen(list(map(str, cmd)), env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    with stopped_at_the_end(proc):
        wait_for(lambda: beat_step(run, 0) >= 3, proc, 240, "step 3")
        listing.write_text("localhost:1\n")
        wait_for(lambda: beat_step(run, 1) >= 8, proc, 240, "step 8 of attempt 1")
        listing.write_text("localhost:2\n")
        _, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 0, stderr[-5000:]
    assert [started(run, a)[0] for a in range(4)] == [2, 1, 2, 2] and not (run / "attempt-4").exists(), stderr[-4000:]
    assert started(run, 1)[2].endswith("model-5"), stderr[-4000:]
    grown, back = (int(started(run, a)[2].rsplit("-", 1)[1]) for a in (2, 3))
    # The grow's own save; the kill inside the save of 20 sent the job back to the last complete one.
    assert 8 <= grown <= back < 20, (grown, back)
    keys, counts, positions, step = counted(model)
    assert sorted(positions) == ["0", "1", "2", "3"]
    left = [GROUPS * GROUP_ROWS - pos.offset for pos in positions.values()]
    assert sum(left) < 2 * 8 * 2, left  # the data ended for a rank: less than a batch of each of its partitions
    seen, times = np.unique(trained_ids(groups, positions), return_counts=True)
    np.testing.assert_array_equal(keys, seen)
    np.testing.assert_array_equal(counts, times)
    # The same rows without a fault: 2 ranks to step 5, 1 to the step the grow saved, 2 to the step
    # the job went back to, 2 to the end.
    for ranks, stop in ((2, 5), (1, grown)) + (((2, back),) if back > grown else ()) + ((2, None),):
        check(mpiexec(ranks, "stream_job.py", *job, "--tag", "reference", "--model", tmp_path / "reference",
                      *(["--stop-at", stop] if stop else []), timeout=240))
    assert counted(tmp_path / "reference")[3] == step
    got, want = _sorted_rows(model), _sorted_rows(tmp_path / "reference")
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
