"""Incremental checkpoints (init(is_incremental_checkpoint=True)): a chain of a full save and deltas,
restored at any of its steps, equals a job that saved a full checkpoint at that step: every table's
keys, values, optimizer slots, admission counts, timestamps and pending keys, and the dense
variables, bitwise; into the same or another number of ranks. The oracle is the same job saving
full checkpoints (tests/mpi_jobs/incremental_job.py)."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from incremental_helpers import JOB, assert_same, gathered
from mpi_helpers import check, kill_during_save, mpiexec, small_disk

CHAIN = "f4,d8,d12,f16,d20,d24"  # deltas across evictions (every 8 steps) and admissions
FULL = "f12,f16,f20,f24"


def train(directory, n, saves, *extra):
    os.makedirs(directory, exist_ok=True)
    check(mpiexec(n, JOB, directory, "train", "--saves", saves, *extra))
    return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The chain and the full saves of the same training, by 1 and by 2 ranks."""
    root = tmp_path_factory.mktemp("incremental")
    return {(kind, n): train(str(root / f"{kind}{n}"), n, CHAIN if kind == "chain" else FULL,
                             *(() if kind == "chain" else ("--plain",)))
            for kind in ("chain", "full") for n in (1, 2)}


def restored(tmp, n, paths, tag="r", extra=()):
    """What `n` ranks hold after restoring each of `paths`: [table dict] (every rank's rows by key)."""
    check(mpiexec(n, JOB, tmp, "restore", "--paths", ",".join(paths), "--tag", tag, *extra))
    return [gathered(tmp, f"{tag}-{i}", n) for i in range(len(paths))]


@pytest.mark.parametrize("saved_by,restored_into", [(1, 1), (1, 2), (2, 2), (2, 1), (2, 3)])
def test_a_chain_restores_exactly_the_full_save_of_its_step(runs, tmp_path, saved_by, restored_into):
    steps = (12, 20, 24)  # a delta two links from its base, a delta on a full, the chain's end
    chain = [os.path.join(runs[("chain", saved_by)], f"model-{s}") for s in steps]
    full = [os.path.join(runs[("full", saved_by)], f"model-{s}") for s in steps]
    got = restored(str(tmp_path), restored_into, chain + full)
    for i, step in enumerate(steps):
        assert int(got[i]["step"]) == step
        assert_same(got[i], got[i + len(steps)], f"step {step}, saved by {saved_by}, restored into {restored_into}")


def test_deltas_hold_what_changed_and_what_was_removed(runs):
    d = runs[("chain", 2)]
    manifests = {s: [json.load(open(f)) for f in sorted(glob.glob(f"{d}/sparse-model-{s}/rank-*/MANIFEST.json"))]
                 for s in (4, 8, 12, 16)}
    assert [m["kind"] for m in manifests[4]] == ["full", "full"]
    for step, previous, base in ((8, 4, 4), (12, 8, 4)):
        for m in manifests[step]:
            assert (m["kind"], m["previous"]["name"], m["base"]["name"]) == ("delta", f"model-{previous}", f"model-{base}")
            assert m["previous"]["save_id"] == manifests[previous][0]["save_id"]
    # The eviction at step 8 removed keys: the delta of step 12 lists them.
    assert sum(m["tables"]["emb"]["removed_rows"] for m in manifests[12]) > 0
    assert len({m["save_id"] for s in manifests for m in manifests[s]}) == 4


def copy_chain(runs, tmp_path):
    d = str(tmp_path / "chain")
    shutil.copytree(runs[("chain", 2)], d)
    return d


def flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))


def test_a_damaged_or_missing_link_is_refused_by_name(runs, tmp_path):
    d = copy_chain(runs, tmp_path)
    flip_a_byte(os.path.join(d, "sparse-model-8", "rank-1-of-2", "emb", "values.npy"))
    proc = check(mpiexec(2, JOB, d, "restore", "--paths", os.path.join(d, "model-12"), "--catch"))
    assert proc.stdout.count("REFUSED") == 2, proc.stdout
    assert "sparse-model-8/rank-1-of-2/emb/values.npy: checksum mismatch" in proc.stdout
    os.remove(os.path.join(d, "sparse-model-12", "rank-0-of-2", "emb", "removed.npy"))
    proc = check(mpiexec(1, JOB, d, "restore", "--paths", os.path.join(d, "model-12"), "--catch"))
    assert "sparse-model-12/rank-0-of-2/emb/removed.npy: missing" in proc.stdout, proc.stdout
    shutil.rmtree(os.path.join(d, "sparse-model-4"))
    proc = check(mpiexec(1, JOB, d, "restore", "--paths", os.path.join(d, "model-12"), "--catch"))
    assert "model-8 holds what changed since " in proc.stdout, proc.stdout
    assert "chain/model-4 (step 4)" in proc.stdout and "sparse-model-4: no sparse checkpoint here" in proc.stdout


def test_restore_model_version(runs, tmp_path):
    d = copy_chain(runs, tmp_path)
    full = runs[("full", 2)]
    want = restored(str(tmp_path), 1, [os.path.join(full, "model-20"), os.path.join(full, "model-16")], tag="want")
    for version, expected in ((20, want[0]), (16, want[1])):  # a delta, a full save
        check(mpiexec(1, JOB, d, "version", "--version", str(version), "--tag", f"v{version}"))
        assert_same(gathered(d, f"v{version}-0", 1), expected, f"restore_model_version={version}")
    proc = check(mpiexec(1, JOB, d, "version", "--version", "13", "--catch"))
    assert "restore_model_version=13" in proc.stdout and "[4, 8, 12, 16, 20, 24]" in proc.stdout, proc.stdout


def test_the_checkpoint_hook_saves_fulls_and_deltas_by_the_timers(tmp_path):
    d = str(tmp_path)
    proc = check(mpiexec(2, JOB, d, "timers", "--steps", "40", "--sleep", "0.12", "--tag", "t"))
    kinds = [json.load(open(f))["kind"] for f in sorted(glob.glob(f"{d}/sparse-model.ckpt-*/rank-0-of-2/MANIFEST.json"))]
    assert kinds.count("full") >= 2 and kinds.count("delta") >= 2, kinds
    latest = gathered(d, "t-latest", 2)
    end = gathered(d, "t-end", 2)
    assert int(latest["step"]) == int(end["step"]) == 40, proc.stdout[-2000:]
    # The pipeline looked batches up beyond step 40 (admitting keys, counting): the checkpoint is as
    # of step 40, so it holds a subset of the keys, each with the rows training left it.
    held = np.isin(end["keys"], latest["keys"])
    assert np.array_equal(end["keys"][held], latest["keys"])
    for name in ("values", "LazyAdam_m", "LazyAdam_v"):
        assert np.array_equal(end[name][held], latest[name]), name
    assert np.array_equal(end["w"], latest["w"])


@pytest.mark.parametrize("variant", ["ssd", "expand", "columns"])
def test_chains_of_ssd_tiered_growing_and_column_wise_tables(tmp_path, variant):
    """With an SSD tier (40 memory rows per rank of 2, two batches' keys: rows move between the
    tiers every step, their changed-flags with them), with dynamic expansion, and column-wise (each
    slice rank's delta joined into whole rows; restored row-wise), a chain restores exactly the full
    save of its step."""
    def option(name):
        if variant != "ssd":
            return () if name == "ssd-restore" and variant == "columns" else (f"--{variant}",)
        os.makedirs(tmp_path / name, exist_ok=True)
        return ("--ssd", str(tmp_path / name))

    chain = train(str(tmp_path / "chain"), 2, CHAIN, *option("ssd-chain"))
    full = train(str(tmp_path / "full"), 2, FULL, "--plain", *option("ssd-full"))
    steps = (20, 24)
    got = restored(str(tmp_path), 2, [os.path.join(chain, f"model-{s}") for s in steps] +
                   [os.path.join(full, f"model-{s}") for s in steps], extra=option("ssd-restore"))
    for i, step in enumerate(steps):
        assert_same(got[i], got[i + len(steps)], f"{variant}: step {step}")
    if variant == "ssd":
        assert all(int(p["on_ssd"]) > 0 for p in map(np.load, glob.glob(str(tmp_path / "r-1-rank*-of2.npz"))))


def kinds(directory, world):
    return {int(m.group(1)): json.load(open(f))["kind"] for f in glob.glob(f"{directory}/sparse-model-*/rank-0-of-{world}/MANIFEST.json")
            for m in [re.search(r"sparse-model-(\d+)/", f)]}


@pytest.mark.parametrize("placement", ["row_wise", "column_wise"])
def test_a_delta_on_a_full_disk_fails_on_every_rank_and_the_next_save_is_full(tmp_path, runs, placement):
    """After the full save of step 16 the disk is full: the delta of step 20 fails on every rank and
    leaves nothing listed; step 16 stays the latest; the next save (asked as a delta) is a full one,
    and equals the full save of its step. Column-wise: the slice rank that cannot write tells the one
    that joins the slices, and both fail."""
    small = tmp_path / "small"
    wrapper = small_disk(small, 8)
    extra = ("--columns",) if placement == "column_wise" else ()
    try:
        proc = check(mpiexec(2, JOB, small, "train", "--saves", CHAIN, "--fill-after", "16", "--catch", *extra,
                             wrapper=wrapper))
        refused = re.findall(r"SAVE-REFUSED rank=(\d) step=(\d+): (.*)", proc.stdout)
        assert sorted((r, s) for r, s, _ in refused) == [("0", "20"), ("1", "20")], proc.stdout[-3000:]
        assert all("No space left on device" in m and "the previous checkpoint stays the latest" in m
                   for _, _, m in refused), refused
        if wrapper is None:  # the tmpfs outlives the job only when this process could mount it
            assert kinds(small, 2) == {4: "full", 8: "delta", 12: "delta", 16: "full", 24: "full"}
            assert not glob.glob(f"{small}/*sparse-model-20*")  # neither in place nor staged
            full = runs[("full", 2)] if not extra else train(str(tmp_path / "full"), 2, FULL, "--plain", *extra)
            got = restored(str(tmp_path), 2, [str(small / "model-24"), os.path.join(full, "model-24")])
            assert_same(got[0], got[1], "the full save after a failed delta")
    finally:
        if wrapper is None:
            subprocess.run(["umount", str(small)], check=False)


def test_a_delta_killed_midway_leaves_the_previous_save_latest_and_exact(tmp_path, runs):
    """Every rank and mpiexec killed while the delta of step 20 is being written: step 16 (a full
    save) stays the latest of the directory, and restores exactly."""
    d = tmp_path / "killed"
    d.mkdir()
    # 3 million keys added after step 16 make the delta of step 20 big enough to be killed while
    # it is written.
    kill_during_save(2, JOB, [d, "train", "--saves", "f4,d8,d12,f16,d20", "--grow-after", 16, "--grow-keys", 1500000],
                     d / "sparse-model-20")
    assert not os.path.exists(d / "model-20.index")
    import tensorflow as tf

    assert tf.train.latest_checkpoint(str(d)) == str(d / "model-16")
    check(mpiexec(1, JOB, d, "version", "--version", "16", "--tag", "after"))
    got = restored(str(tmp_path), 1, [os.path.join(runs[("full", 2)], "model-16")], tag="want")
    assert_same(gathered(str(d), "after-0", 1), got[0], "step 16 after a killed delta")


def test_shardrec_ckpt_and_the_serving_export_read_a_chain_at_its_step(runs, tmp_path):
    import tensorflow as tf
    from serving_helpers import serve

    from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows
    from shardrec.rank_runtime import create_table, export_saved_model, sparse_lookup

    chain, full = runs[("chain", 2)], runs[("full", 2)]
    got = table_rows(find_checkpoints(os.path.join(chain, "model-20"))[0], "emb")
    want = table_rows(find_checkpoints(os.path.join(full, "model-20"))[0], "emb")
    order_got, order_want = np.argsort(got["keys"]), np.argsort(want["keys"])
    assert len(got["keys"]) > 20 and "removed" not in got
    for name in ("keys", "values", "LazyAdam.m", "LazyAdam.v", "counts", "last_seen"):
        assert np.array_equal(got[name][order_got], want[name][order_want]), name
    by_got, by_want = np.argsort(got["pending_keys"]), np.argsort(want["pending_keys"])
    for name in ("pending_keys", "pending_counts", "pending_last_seen"):
        assert np.array_equal(got[name][by_got], want[name][by_want]), name
    cli = os.path.join(os.path.dirname(sys.executable), "shardrec-ckpt")
    inspected = subprocess.run([cli, "inspect", chain], capture_output=True, text=True)
    assert inspected.returncode == 0, inspected.stdout + inspected.stderr
    assert "model-20: step 20, delta on model-16, world size 2, OK" in inspected.stdout, inspected.stdout
    broken = str(tmp_path / "broken")
    shutil.copytree(chain, broken)
    shutil.rmtree(os.path.join(broken, "sparse-model-16"))
    inspected = subprocess.run([cli, "inspect", broken], capture_output=True, text=True)
    assert inspected.returncode == 1 and "model-24: step 24, delta on model-20, world size 2, DAMAGED" in inspected.stdout
    assert "its chain is broken" in inspected.stdout and "sparse-model-16: no sparse checkpoint here" in inspected.stdout

    def outputs(features):
        table = create_table(tf.int64, 4, "emb", tf.compat.v1.zeros_initializer())
        w = tf.compat.v1.get_variable("w", [4])
        return {"emb": sparse_lookup(table, features["ids"], modify_graph=True), "w": tf.identity(w)}

    export_saved_model(os.path.join(chain, "model-20"), str(tmp_path / "export"), outputs,
                       {"ids": tf.TensorSpec([None], tf.int64)})
    keys = want["keys"][order_want]
    served = serve(tmp_path / "export", {"ids": keys}, tmp_path)
    np.testing.assert_array_equal(served["emb"], want["values"][order_want])
    np.testing.assert_array_equal(served["w"], tf.train.load_variable(os.path.join(full, "model-20"), "w"))


def test_the_supervisor_restarts_from_the_newest_complete_chain(runs, tmp_path):
    from shardrec.orchestrator.supervisor import latest_checkpoint

    d = copy_chain(runs, tmp_path)
    assert latest_checkpoint(d) == (os.path.join(d, "model-24"), 24)
    flip_a_byte(os.path.join(d, "sparse-model-16", "rank-0-of-2", "emb", "LazyAdam.v.npy"))
    # model-16's own files are damaged: model-20 and model-24 build on it.
    assert latest_checkpoint(d) == (os.path.join(d, "model-12"), 12)
    shutil.rmtree(os.path.join(d, "sparse-model-8"))  # model-12 builds on it
    assert latest_checkpoint(d) == (os.path.join(d, "model-4"), 4)


def test_the_demo_saves_a_chain_in_its_session_loop_and_resumes_from_it(tmp_path):
    """examples/wide_deep.py --incremental: the guide's init parameters and Saver.maybe_save after
    every step of a plain Session loop; a later run resumes from the chain's end."""
    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "wide_deep.py")
    common = ("--incremental", "2,1", "--eval-samples", "2000", "--model-dir", tmp_path)
    first = check(mpiexec(2, demo, "--steps", "150", *common))
    assert "a full checkpoint every 2 s and a delta every 1 s" in first.stderr
    saved = kinds(tmp_path, 2)
    assert saved[150] in ("full", "delta") and list(saved.values()).count("delta") >= 1, saved
    assert saved[min(saved)] == "full", saved
    second = check(mpiexec(2, demo, "--steps", "200", *common))
    assert re.findall(r"SUMMARY rank=\d/2 steps=200 resumed_from=(\d+)", second.stdout) == ["150", "150"], second.stdout


def test_warm_start_from_a_chain_takes_the_rows_of_its_step(runs, runtime):
    import tensorflow as tf

    from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows
    from shardrec.rank_runtime import create_table
    from shardrec.rank_runtime.checkpoint.warm_start import warm_start

    table = create_table(tf.int64, 4, "emb", tf.compat.v1.zeros_initializer(), device_vocabulary_size=4096)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        warm_start(sess, tf.estimator.WarmStartSettings(ckpt_to_initialize_from=os.path.join(runs[("chain", 2)],
                                                                                             "model-20"),
                                                        vars_to_warm_start="emb"))
        got = table.export(sess)
    want = table_rows(find_checkpoints(os.path.join(runs[("full", 2)], "model-20"))[0], "emb")
    order_got, order_want = np.argsort(got["keys"]), np.argsort(want["keys"])
    assert len(got["keys"]) > 20
    np.testing.assert_array_equal(got["keys"][order_got], want["keys"][order_want])
    np.testing.assert_array_equal(got["values"][order_got], want["values"][order_want])


@pytest.mark.parametrize("kinds,keep,gone", [
    (["full", "full", "full"], 2, 1),  # TensorFlow's rule when every save is full
    (["full", "delta", "delta"], 2, 0),  # the newest two build on the oldest
    (["full", "delta", "full", "delta"], 2, 2),  # a newer full: the old chain goes whole
    (["full", "delta", "delta", "full"], 2, 0),  # the newest two: a delta of the old chain and the full
    (["full", "delta", "delta", "full", "delta"], 2, 3),
    (["delta", "delta", "full"], 1, 2),  # deltas whose base went before (an earlier process's)
    (["full", "delta"], 0, 0),  # max_to_keep 0 or None: everything stays
])
def test_max_to_keep_lets_a_chain_go_only_whole_and_after_a_newer_full_save(kinds, keep, gone):
    from shardrec.rank_runtime.checkpoint.save_schedule import old_links

    assert old_links(kinds, keep) == gone


def test_a_save_after_a_warm_start_is_full(runs, graph, tmp_path):
    """A warm start empties the table first (keys in no removal list): the next save, even one asked
    as a delta, is a full save, and it holds exactly what was warm-started."""
    import tensorflow as tf

    from shardrec.rank_runtime import create_table
    from shardrec.rank_runtime.process import lifecycle
    from shardrec.rank_runtime.checkpoint.warm_start import warm_start

    lifecycle.init(is_incremental_checkpoint=True, save_checkpoint_due_time=600, save_delta_checkpoints_secs=1)
    table = create_table(tf.int64, 4, "emb", tf.compat.v1.zeros_initializer(), device_vocabulary_size=4096)
    tf.compat.v1.train.get_or_create_global_step()
    saver = tf.compat.v1.train.Saver()
    prefix = str(tmp_path / "model")
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        table.index.lookup(np.arange(1000, 1100, dtype=np.int64), allocate=True)
        saver.save(sess, prefix, global_step=1, save_delta=False)
        warm_start(sess, tf.estimator.WarmStartSettings(os.path.join(runs[("chain", 2)], "model-20"),
                                                        vars_to_warm_start="emb"))
        held = np.sort(table.export(sess)["keys"])
        saver.save(sess, prefix, global_step=2, save_delta=True)
        saver.save(sess, prefix, global_step=3, save_delta=True)
    assert kinds(tmp_path, 1) == {1: "full", 2: "full", 3: "delta"}
    saved = np.sort(np.load(tmp_path / "sparse-model-2" / "rank-0-of-1" / "emb" / "keys.npy"))
    np.testing.assert_array_equal(saved, held)
    assert not np.isin(np.arange(1000, 1100), saved).any()
