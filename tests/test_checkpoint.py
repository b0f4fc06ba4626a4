"""Per-rank sparse checkpoints under real mpiexec: resharding N -> M, exact resume, a save killed
midway, corrupted files; the oracle is what the saving ranks held (dumped by the job itself)."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from mpi_helpers import JOBS, check, kill_during_save, mpiexec, segments_left_behind
from shardrec.orchestrator.job_kill import segments_now as shm_segments_now

JOB = "ckpt_job.py"
sys.path.insert(0, JOBS)


def checkpoint_state(directory, latest_filename=None):
    """The state file as plain TensorFlow reads it (whatever shardrec installed in this process)."""
    from shardrec.rank_runtime.checkpoint import checkpoint_state

    return checkpoint_state.tf_get_checkpoint_state(str(directory), latest_filename)


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


@pytest.mark.quick
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


@pytest.mark.quick
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


def _latest(proc):
    return dict(re.findall(r"LATEST rank=(\d) path=(\S+)", proc.stdout))


def test_per_rank_paths_restore_into_the_same_ranks_only(tmp_path):
    proc = check(mpiexec(2, JOB, "--out", tmp_path, "--tag", "src", "--start", 0, "--end", 6, "--save",
                         tmp_path / "model", "--per-rank-prefix", timeout=240))
    assert os.path.exists(tmp_path / "model-0-6.index") and os.path.exists(tmp_path / "model-1-6.index")
    # Seed 001's loop: each rank's latest_checkpoint is its own, in this job and in the next.
    assert _latest(proc) == {"0": "model-0-6", "1": "model-1-6"}
    _per_rank_checkpoint_exports(tmp_path, [str(tmp_path / f"model-{r}-6") for r in (0, 1)])
    proc = check(mpiexec(2, JOB, "--out", tmp_path, "--tag", "next", "--start", 6, "--end", 8, "--restore-latest",
                         tmp_path, "--save", tmp_path / "model", "--per-rank-prefix", timeout=240))
    assert _latest(proc) == {"0": "model-0-8", "1": "model-1-8"}
    for rank in (0, 1):
        state = checkpoint_state(tmp_path, f"checkpoint.rank-{rank}")
        assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == [f"model-{rank}-6",
                                                                                  f"model-{rank}-8"]
    proc = mpiexec(1, JOB, "--out", tmp_path, "--tag", "bad", "--restore", tmp_path / "model-0-6", timeout=120)
    assert proc.returncode != 0
    assert "written by 2 ranks each under its own path" in proc.stderr and "same path on every rank" in proc.stderr


def _per_rank_checkpoint_exports(tmp_path, prefixes):
    """A checkpoint saved under a path per rank exports from every rank's prefix (and names them when
    given one): served rows are both shards' rows, the dense variable rank 0's."""
    from ckpt_job import DENSE, FIELDS
    from serving_helpers import serve

    from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows
    from shardrec.rank_runtime import create_table, export_saved_model, sparse_lookup
    from shardrec.rank_runtime.formats.sparse_checkpoint import CheckpointError

    def outputs(features):
        table = create_table(tf.int64, 4, "emb", tf.compat.v1.zeros_initializer())
        w = tf.compat.v1.get_variable("w", [FIELDS * 4 + DENSE, 1])
        return {"emb": sparse_lookup(table, features["ids"], modify_graph=True), "w": tf.identity(w)}

    inputs = {"ids": tf.TensorSpec([None], tf.int64)}
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\] of 2 are missing.*each under its own path.*every "
                                              r"rank's checkpoint prefix"):
        export_saved_model(prefixes[0], str(tmp_path / "one"), outputs, inputs)
    export_saved_model(prefixes, str(tmp_path / "export"), outputs, inputs)
    rows = {}
    for prefix in prefixes:
        part = table_rows(find_checkpoints(prefix)[0], "emb")
        rows.update(zip(part["keys"].tolist(), part["values"]))
    served = serve(tmp_path / "export", {"ids": np.array(sorted(rows), np.int64)}, tmp_path)
    np.testing.assert_array_equal(served["emb"], np.stack([rows[k] for k in sorted(rows)]))
    np.testing.assert_array_equal(served["w"], tf.train.load_variable(prefixes[0], "w"))


def test_a_save_killed_midway_leaves_the_previous_checkpoint_latest(tmp_path):
    # Big enough that the killed save is still writing when the loop below sees its folder.
    big = ["--dim", "64", "--vocab", "1200000"]
    check(mpiexec(2, JOB, "--out", tmp_path, "--tag", "before", "--start", 0, "--end", 10, "--save",
                  tmp_path / "model", *big, timeout=300))
    segments = shm_segments_now()
    kill_during_save(2, JOB, ["--out", tmp_path, "--tag", "killed", "--start", 10, "--end", 12, "--restore",
                              tmp_path / "model-10", "--save", tmp_path / "model", "--extra-keys", 500000, *big],
                     tmp_path / "sparse-model-12")
    assert not segments_left_behind(segments), "the killed job's shared memory is left in /dev/shm"
    assert not os.path.exists(tmp_path / "model-12.index")
    # Plain TensorFlow (no shardrec in this process's view) and a fresh job both find model-10 as
    # the latest, without being told; the job restores it exactly.
    assert checkpoint_state(tmp_path).model_checkpoint_path == str(tmp_path / "model-10")
    assert tf.train.latest_checkpoint(str(tmp_path)) == str(tmp_path / "model-10")
    check(mpiexec(2, JOB, "--out", tmp_path, "--tag", "after", "--restore-latest", tmp_path, *big, timeout=300))
    before, after = _load(tmp_path, "before", 2), _load(tmp_path, "after", 2)
    for r in range(2):
        for what in ("keys", "values", "LazyAdam.m"):
            np.testing.assert_array_equal(after[r][f"emb.{what}"], before[r][f"emb.{what}"])
    # The next save, in another process, keeps model-10 listed beside its own.
    proc = check(mpiexec(2, JOB, "--out", tmp_path, "--tag", "later", "--start", 10, "--end", 11, "--restore-latest",
                         tmp_path, "--save", tmp_path / "model", *big, timeout=300))
    assert _latest(proc) == {"0": "model-11", "1": "model-11"}
    assert [os.path.basename(p) for p in checkpoint_state(tmp_path).all_model_checkpoint_paths] == ["model-10",
                                                                                                   "model-11"]


def test_a_save_failing_on_one_rank_fails_on_every_rank_and_lists_nothing(tmp_path):
    (tmp_path / "blocked").write_text("a regular file where rank 1's directory should be")
    proc = check(mpiexec(2, JOB, "--out", tmp_path, "--tag", "x", "--start", 0, "--end", 4, "--save",
                         tmp_path / "model", "--per-rank-prefix", "--rank1-save", tmp_path / "blocked" / "model",
                         "--catch-save", timeout=240))
    refused = dict(re.findall(r"SAVE-REFUSED rank=(\d): (.*)", proc.stdout))
    assert sorted(refused) == ["0", "1"], proc.stdout + proc.stderr[-3000:]
    for line in refused.values():
        assert "failed on rank(s) [1] (rank 1: " in line and "blocked" in line, line
        assert "nothing was committed; the previous checkpoint stays the latest" in line
    # Rank 0's shard was committed in its staging directory, which went with the failed save;
    # neither its dense part nor its state file was written.
    assert not [e for e in os.listdir(tmp_path) if "sparse-model-0-4" in e]
    assert not (tmp_path / "model-0-4.index").exists()
    assert not (tmp_path / "checkpoint.rank-0").exists() and not (tmp_path / "checkpoint").exists()


def test_a_shard_damaged_on_one_rank_is_refused_on_every_rank_and_nothing_loads(saved, tmp_path):
    shutil.copytree(saved / "n2", tmp_path / "n2")
    _flip_byte(tmp_path / "n2" / "sparse-model-10")  # rank 1's shard only
    proc = check(mpiexec(2, JOB, "--out", tmp_path, "--tag", "x", "--restore", tmp_path / "n2" / "model-10",
                         "--catch-restore", timeout=240))
    refused = dict(re.findall(r"REFUSED rank=(\d) (.*)", proc.stdout))
    assert sorted(refused) == ["0", "1"], proc.stdout + proc.stderr[-3000:]
    for line in refused.values():
        assert line.startswith("keys=0 w_kept=1: Saver.restore("), line
        assert "failed on rank(s) [1]" in line and "rank 1: " in line and "checksum mismatch" in line
        assert "nothing was loaded on any rank" in line


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


def _edit_rows(root):
    path = root / "rank-0-of-2" / "MANIFEST.json"
    manifest = json.loads(path.read_text())
    manifest["tables"]["emb"]["rows"] += 1
    path.write_text(json.dumps(manifest))


CORRUPTIONS = [
    (_edit_rows, r"rank-0-of-2/emb/keys.npy: \d+ keys, but the manifest says rows = \d+"),
    (_flip_byte, r"rank-1-of-2/emb/values.npy: checksum mismatch"),
    (_truncate, r"rank-0-of-2/emb/keys.npy: \d+ bytes, the manifest says \d+"),
    (lambda root: shutil.rmtree(root / "rank-1-of-2"), r"shards of rank\(s\) \[1\] of 2 are missing"),
    (lambda root: os.remove(root / "rank-0-of-2" / "MANIFEST.json"), r"shards of rank\(s\) \[0\] of 2 are missing"),
    (lambda root: (root / "rank-0-of-2" / "MANIFEST.json").write_text("{not json"),
     r"rank-0-of-2/MANIFEST.json: not a valid manifest"),
]


@pytest.mark.parametrize("damage,message", CORRUPTIONS, ids=["edited_rows", "flipped_byte", "truncated", "missing_rank",
                                                             "missing_manifest", "garbled_manifest"])
def test_damaged_checkpoint_is_refused_naming_the_file(saved, tmp_path, runtime, damage, message):
    from shardrec.rank_runtime.formats.sparse_checkpoint import CheckpointError

    path = _damaged_copy(saved, tmp_path, damage)
    with pytest.raises(CheckpointError, match=message):
        _restore_in_process(path)


@pytest.mark.parametrize("kwargs,message", [
    (dict(dim=8), r"rank-\d-of-2/MANIFEST.json: table 'emb' was saved with dim 4 \(this graph: 8\)"),
    (dict(optimizer="sgd"), r"rank-\d-of-2/MANIFEST.json: table 'emb' was saved with optimizer\(s\) \['LazyAdam'\] "
                            r"\(this graph: \['GradientDescent'\]\)"),
], ids=["dim", "optimizer"])
def test_checkpoint_of_another_layout_is_refused(saved, runtime, kwargs, message):
    from shardrec.rank_runtime.formats.sparse_checkpoint import CheckpointError

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


def test_export_gathers_every_rank_s_rows_of_a_table_into_one_npz(saved, tmp_path):
    cli = os.path.join(os.path.dirname(sys.executable), "shardrec-ckpt")
    out = tmp_path / "emb.npz"
    proc = subprocess.run([cli, "export", str(saved / "n2"), "--table", "emb", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "model-10 (step 10): table emb:" in proc.stdout
    exported = np.load(out, allow_pickle=False)
    assert sorted(exported.files) == ["LazyAdam.m", "LazyAdam.v", "keys", "values"]
    source = _load(saved, "src2", 2)
    for what in ("values", "LazyAdam.m", "LazyAdam.v"):
        want = _by_key(source, "emb", what)
        assert sorted(exported["keys"].tolist()) == sorted(want)
        for key, row in zip(exported["keys"].tolist(), exported[what]):
            np.testing.assert_array_equal(row, want[key], err_msg=f"{what} key {key}")
    proc = subprocess.run([cli, "export", str(saved / "n2"), "--table", "nope"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 1 and "has no table 'nope'; it has ['emb', 'wide']" in proc.stderr


def test_rank_0_writes_the_tables_counters_summed_over_ranks_as_tensorboard_scalars(saved):
    events = [os.path.join(saved / "n2" / "shardrec_counters", f) for f in os.listdir(saved / "n2" / "shardrec_counters")]
    assert len(events) == 1, "rank 0 alone writes them"
    scalars = {v.tag: v.simple_value for e in tf.compat.v1.train.summary_iterator(events[0]) if e.step == 10
               for v in e.summary.value}
    source = _load(saved, "src2", 2)
    for table in ("emb", "wide"):
        assert scalars[f"shardrec/{table}/size"] == sum(len(d[f"{table}.keys"]) for d in source)
        assert scalars[f"shardrec/{table}/keys_sent"] == scalars[f"shardrec/{table}/keys_received"] > 0
    assert scalars["shardrec/emb/capacity"] == 2000  # the whole table: 1000 rows on each of 2 ranks


def test_if_load_refuses_a_save_before_a_restore_and_writes_nothing(saved, tmp_path, graph):
    """init(if_load=True) (the Rec SDK's "load a trained model"): a save before any restore would
    write fresh tables over that model; it is refused, and allowed once the model is restored."""
    from shardrec.rank_runtime.process import lifecycle
    from mx_rec.util.initialize import ConfigInitializer, set_if_load

    lifecycle.init(if_load=True)
    assert ConfigInitializer.get_instance().if_load
    g = _job_module().build()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(RuntimeError, match=r"init\(if_load=True\) / set_if_load\(True\) says this run continues "
                                               r"a trained model, but nothing was restored before this save"):
            g["saver"].save(sess, str(tmp_path / "model"), global_step=1)
        assert os.listdir(tmp_path) == []
        g["saver"].restore(sess, str(saved / "n1" / "model-10"))
        assert g["tables"][0].size() > 0
        g["saver"].save(sess, str(tmp_path / "model"), global_step=11)
        assert tf.train.latest_checkpoint(str(tmp_path)) == str(tmp_path / "model-11")
    set_if_load(False)
    assert not ConfigInitializer.get_instance().if_load


def test_a_restarted_attempt_must_load_the_checkpoint_the_supervisor_names(saved, tmp_path, graph, monkeypatch):
    from shardrec.rank_runtime.process import config, lifecycle
    from shardrec.rank_runtime import resume_checkpoint

    monkeypatch.setenv("SHARDREC_RESUME_FROM", str(saved / "n1" / "model-10"))
    lifecycle.init()
    assert config.get_if_load() and resume_checkpoint() == str(saved / "n1" / "model-10")
    g = _job_module().build()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(RuntimeError, match=r"the supervisor restarted this job to resume from \S+model-10 says"):
            g["saver"].save(sess, str(tmp_path / "model"), global_step=1)
        g["saver"].restore(sess, resume_checkpoint())
        g["saver"].save(sess, str(tmp_path / "model"), global_step=11)
