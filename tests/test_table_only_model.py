"""A model of tables alone (matrix factorization: a user and an item table and their dot product,
SGD, no dense variable, no global step) saves, restores into other rank counts, chains deltas and
exports like any other: TensorFlow's Saver keeps no dense part for it, and shardrec's writes one."""
import glob
import os
import sys

import numpy as np
import pytest

from mpi_helpers import JOBS, check, mpiexec
from serving_helpers import serve

JOB = "mf_job.py"
TABLES = ("user", "item")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """2 ranks: a full save at step 6, a delta at 9, a full save at 12, and what they held at each."""
    d = tmp_path_factory.mktemp("mf")
    proc = check(mpiexec(2, JOB, d, "train", "--saves", "f6,d9,f12"))
    assert proc.stdout.count("SAVED rank=") == 6, proc.stdout
    return d


def rows(directory, tag, n):
    """{table: {key: row}} of what `n` ranks dumped under `tag`; each key held by one rank only."""
    parts = [np.load(f) for f in sorted(glob.glob(os.path.join(directory, f"{tag}-rank*-of{n}.npz")))]
    assert len(parts) == n
    out = {}
    for table in TABLES:
        keys = np.concatenate([p[f"{table}_keys"] for p in parts])
        assert len(np.unique(keys)) == len(keys) > 20, (table, len(keys))
        values = np.concatenate([p[f"{table}_values"] for p in parts])
        out[table] = dict(zip(keys.tolist(), values))
    return out


def assert_same(a, b):
    for table in TABLES:
        assert sorted(a[table]) == sorted(b[table]), f"{table}: other keys"
        for key, row in a[table].items():
            np.testing.assert_array_equal(row, b[table][key], err_msg=f"{table} key {key}")


def seen_keys(step):
    """{table: set of keys} of the global batches up to `step`: what the job holds after it."""
    sys.path.insert(0, JOBS)
    from mf_job import GLOBAL_BATCH, ratings

    users, items, _ = ratings()
    return {"user": set(users[:step * GLOBAL_BATCH, 0].tolist()), "item": set(items[:step * GLOBAL_BATCH, 0].tolist())}


@pytest.mark.parametrize("step", [6, 9, 12])
def test_each_save_and_its_dump_hold_exactly_the_keys_trained_so_far(trained, step):
    """No batch runs ahead into the dump (the job turns tf.data's injected prefetch off), so the
    dump the restores are compared with holds the saved step's keys, and only those."""
    held = rows(trained, f"train-{step}", 2)
    assert {table: set(held[table]) for table in TABLES} == seen_keys(step)


def test_the_dense_part_of_a_table_only_checkpoint_is_written_and_listed(trained):
    import tensorflow as tf

    assert tf.train.latest_checkpoint(str(trained)).endswith("mf-12")
    for step in (6, 9, 12):
        assert os.path.isfile(trained / f"mf-{step}.index") and os.path.isdir(trained / f"sparse-mf-{step}")
    names = [n for n, _ in tf.train.list_variables(str(trained / "mf-12"))]
    assert names == ["shardrec_no_dense_variables"], names


@pytest.mark.parametrize("step,n", [(6, 1), (9, 3), (12, 3)])
def test_a_table_only_model_restores_into_another_rank_count_exactly(trained, tmp_path, step, n):
    """Step 9 is a delta on step 6: the chain, restored into 3 ranks."""
    check(mpiexec(n, JOB, tmp_path, "restore", "--path", trained / f"mf-{step}", "--tag", "r"))
    assert_same(rows(tmp_path, "r", n), rows(trained, f"train-{step}", 2))


def test_a_table_only_model_exports_and_serves_its_rows(trained, tmp_path):
    """shardrec-export of the model directory (its newest save, step 12); the served score of each
    pair is the dot product of the saved rows, and 0 for an unseen user."""
    import subprocess

    out = tmp_path / "export"
    cli = subprocess.run([os.path.join(os.path.dirname(sys.executable), "shardrec-export"), str(trained), "--out",
                          str(out), "--model-fn", f"{os.path.join(JOBS, JOB)}:serving_outputs",
                          "--feature", "user=int64[-1]", "--feature", "item=int64[-1]"],
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    saved = rows(trained, "train-12", 2)
    users = np.array(sorted(saved["user"])[:10] + [10_000], np.int64)
    items = np.array(sorted(saved["item"])[:11], np.int64)
    served = serve(out, {"user": users, "item": items}, tmp_path)["score"]
    want = [float(np.dot(saved["user"][u], saved["item"][i])) if u in saved["user"] else 0.0
            for u, i in zip(users.tolist(), items.tolist())]
    np.testing.assert_allclose(served, want, rtol=1e-6, atol=1e-7)
    assert served[-1] == 0.0
