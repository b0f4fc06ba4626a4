"""Per-rank sparse checkpoints under real mpiexec: resharding N -> M, exact resume, a save killed
midway, corrupted files; the oracle is what the saving ranks held (dumped by the job itself)."""
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from mpi_helpers import JOBS, check, mpiexec

JOB = "ckpt_job.py"


def _load(directory, tag, n):
    return [dict(np.load(os.path.join(directory, f"{tag}-rank{r}-of{n}.npz"))) for r in range(n)]


def _by_key(dumps, table, what):
    out = {}
    for d in dumps:
        for key, row in zip(d[f"{table}.keys"].tolist(), d[f"{table}.{what}"]):
            assert key not in out, f"{table}: key {key} held by two ranks"
            out[key] = row
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of 10 training steps written by 1, 2 and 4 ranks, each under one shared path."""
    d = tmp_path_factory.mktemp("ckpt")
    for n in (1, 2, 4):
        os.makedirs(d / f"n{n}")
        check(mpiexec(n, JOB, "--out", d, "--tag", f"src{n}", "--start", 0, "--end", 10, "--save",
                      d / f"n{n}" / "model", timeout=240))
    return d


@pytest.mark.parametrize("src,dst", [(2, 1), (1, 4), (4, 2)])
def test_reshard_restores_every_key_with_its_rows_and_slots(saved, src, dst):
    check(mpiexec(dst, JOB, "--out", saved, "--tag", f"re{src}to{dst}", "--restore",
                  saved / f"n{src}" / "model-10", timeout=240))
    source, restored = _load(saved, f"src{src}", src), _load(saved, f"re{src}to{dst}", dst)
    for rank, d in enumerate(restored):
        for table in ("emb", "wide"):
            assert np.all(np.mod(d[f"{table}.keys"], dst) == rank), "each rank keeps the keys it owns under M"
        np.testing.assert_array_equal(d["w"], source[0]["w"])
        assert d["step"] == 10
    for table in ("emb", "wide"):
        for what in ("values", "LazyAdam.m", "LazyAdam.v"):
            want, got = _by_key(source, table, what), _by_key(restored, table, what)
            assert set(got) == set(want), f"{table}: restored key set differs"
            for key, row in want.items():
                np.testing.assert_array_equal(got[key], row, err_msg=f"{table} {what} key {key}")


def test_dense_part_is_written_once_and_every_rank_writes_its_shard(saved):
    files = os.listdir(saved / "n4")
    assert sorted(f for f in files if f.startswith("model-10")) == ["model-10.data-00000-of-00001", "model-10.index",
                                                                    "model-10.meta"]
    assert sorted(os.listdir(saved / "n4" / "sparse-model-10")) == [f"rank-{r}-of-4" for r in range(4)]


def test_resume_is_exact_on_two_ranks(saved, tmp_path):
    check(mpiexec(2, JOB, "--out", tmp_path, "--tag", "straight", "--start", 0, "--end", 20, timeout=240))
    check(mpiexec(2, JOB, "--out", tmp_path, "--tag", "resumed", "--start", 10, "--end", 20, "--restore",
                  saved / "n2" / "model-10", timeout=240))
    first, straight, resumed = _load(saved, "src2", 2), _load(tmp_path, "straight", 2), _load(tmp_path, "resumed", 2)
    for r in range(2):
        np.testing.assert_array_equal(np.concatenate([first[r]["losses"], resumed[r]["losses"]]), straight[r]["losses"])
        np.testing.assert_array_equal(resumed[r]["w"], straight[r]["w"])
        for table in ("emb", "wide"):
            np.testing.assert_array_equal(resumed[r][f"{table}.keys"], straight[r][f"{table}.keys"])
            for what in ("values", "LazyAdam.m", "LazyAdam.v"):
                np.testing.assert_array_equal(resumed[r][f"{table}.{what}"], straight[r][f"{table}.{what}"])


def test_per_rank_paths_restore_into_the_same_ranks_only(tmp_path):
    check(mpiexec(2, JOB, "--out", tmp_path, "--tag", "src", "--start", 0, "--end", 6, "--save", tmp_path / "model",
                  "--per-rank-prefix", timeout=240))
    assert os.path.exists(tmp_path / "model-0-6.index") and os.path.exists(tmp_path / "model-1-6.index")
    proc = mpiexec(1, JOB, "--out", tmp_path, "--tag", "bad", "--restore", tmp_path / "model-0-6", timeout=120)
    assert proc.returncode != 0
    assert "written by 2 ranks each under its own path" in proc.stderr and "same path on every rank" in proc.stderr


def test_a_save_killed_midway_leaves_the_previous_checkpoint_latest(tmp_path):
    big = ["--dim", "64", "--vocab", "3400000"]
    check(mpiexec(2, JOB, "--out", tmp_path, "--tag", "before", "--start", 0, "--end", 10, "--save",
                  tmp_path / "model", *big, timeout=300))
    launcher = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([launcher, "--oversubscribe", "-np", "2", sys.executable, os.path.join(JOBS, JOB),
                             "--out", str(tmp_path), "--tag", "killed", "--start", "10", "--end", "12", "--restore",
                             str(tmp_path / "model-10"), "--save", str(tmp_path / "model"), "--extra-keys", "1600000",
                             *big], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    partial = tmp_path / "sparse-model-12"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.exists() and any(e.startswith(".tmp-") for e in os.listdir(partial)):
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the job ended before its save began"
    os.killpg(proc.pid, signal.SIGKILL)  # every rank and mpiexec, while shard files are being written
    proc.wait()
    assert not os.path.exists(tmp_path / "model-12.index")
    # A fresh job finds model-10 as the latest and restores it exactly.
    check(mpiexec(2, JOB, "--out", tmp_path, "--tag", "after", "--restore", tmp_path / "model-10", *big, timeout=300))
    before, after = _load(tmp_path, "before", 2), _load(tmp_path, "after", 2)
    for r in range(2):
        for what in ("keys", "values", "LazyAdam.m"):
            np.testing.assert_array_equal(after[r][f"emb.{what}"], before[r][f"emb.{what}"])


# In-process checks of bad checkpoints: one rank restoring the 2-rank checkpoint (a reshard, so it
# reads both shards), each time from a damaged copy.

def _job_module():
    spec = importlib.util.spec_from_file_location("ckpt_job", os.path.join(JOBS, JOB))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _damaged_copy(saved, tmp_path, damage):
    shutil.copytree(saved / "n2", tmp_path / "n2")
    damage(tmp_path / "n2" / "sparse-model-10")
    return str(tmp_path / "n2" / "model-10")


def _restore_in_process(path, dim=4, optimizer="lazy_adam"):
    g = _job_module().build(dim=dim, optimizer=optimizer)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        before = sess.run(g["tables"][0].variable)
        try:
            g["saver"].restore(sess, path)
        except Exception:
            # A restore that fails writes nothing: no key, no row.
            assert g["tables"][0].size() == 0 and g["tables"][1].size() == 0
            np.testing.assert_array_equal(sess.run(g["tables"][0].variable), before)
            raise


def _flip_byte(root):
    path = root / "rank-1-of-2" / "emb" / "values.npy"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(root):
    path = root / "rank-0-of-2" / "emb" / "keys.npy"
    path.write_bytes(path.read_bytes()[:-16])


CORRUPTIONS = [
    (_flip_byte, r"rank-1-of-2/emb/values.npy: checksum mismatch"),
    (_truncate, r"rank-0-of-2/emb/keys.npy: \d+ bytes, the manifest says \d+"),
    (lambda root: shutil.rmtree(root / "rank-1-of-2"), r"shards of rank\(s\) \[1\] of 2 are missing"),
    (lambda root: os.remove(root / "rank-0-of-2" / "MANIFEST.json"), r"shards of rank\(s\) \[0\] of 2 are missing"),
    (lambda root: (root / "rank-0-of-2" / "MANIFEST.json").write_text("{not json"),
     r"rank-0-of-2/MANIFEST.json: not a valid manifest"),
]


@pytest.mark.parametrize("damage,message", CORRUPTIONS, ids=["flipped_byte", "truncated", "missing_rank",
                                                             "missing_manifest", "garbled_manifest"])
def test_damaged_checkpoint_is_refused_naming_the_file(saved, tmp_path, runtime, damage, message):
    from rank_runtime.sparse_checkpoint import CheckpointError

    path = _damaged_copy(saved, tmp_path, damage)
    with pytest.raises(CheckpointError, match=message):
        _restore_in_process(path)


@pytest.mark.parametrize("kwargs,message", [
    (dict(dim=8), r"rank-\d-of-2/MANIFEST.json: table 'emb' was saved with dim 4 \(this graph: 8\)"),
    (dict(optimizer="sgd"), r"rank-\d-of-2/MANIFEST.json: table 'emb' was saved with optimizer\(s\) \['LazyAdam'\] "
                            r"\(this graph: \['GradientDescent'\]\)"),
], ids=["dim", "optimizer"])
def test_checkpoint_of_another_layout_is_refused(saved, runtime, kwargs, message):
    from rank_runtime.sparse_checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=message):
        _restore_in_process(str(saved / "n2" / "model-10"), **kwargs)


def test_latest_checkpoint_skips_one_with_a_missing_shard(saved, tmp_path, runtime):
    shutil.copytree(saved / "n2", tmp_path / "n2")
    newer = tmp_path / "n2" / "model-20"
    for suffix in (".index", ".data-00000-of-00001", ".meta"):
        shutil.copy(str(tmp_path / "n2" / "model-10") + suffix, str(newer) + suffix)
    shutil.copytree(tmp_path / "n2" / "sparse-model-10", tmp_path / "n2" / "sparse-model-20")
    tf.compat.v1.train.update_checkpoint_state(str(tmp_path / "n2"), str(newer),
                                               [str(tmp_path / "n2" / "model-10"), str(newer)])
    assert tf.train.latest_checkpoint(str(tmp_path / "n2")) == str(newer)
    shutil.rmtree(tmp_path / "n2" / "sparse-model-20" / "rank-1-of-2")  # rank 1 died while saving
    assert tf.train.latest_checkpoint(str(tmp_path / "n2")) == str(tmp_path / "n2" / "model-10")
