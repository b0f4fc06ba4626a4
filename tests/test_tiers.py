"""The SSD tier (create_table's host_vocabulary_size / ssd_vocabulary_size / ssd_data_path):
training with most rows on SSD equals training with every row in memory (plain tables, 1 and 2
ranks), checkpoints restore into other layouts and rank counts, a table larger than the process's
memory limit trains, a full disk and a damaged file stop every rank with a clear error
(test_tier_index.py drives the native index's tier directly)."""
import json
import re
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import admission_oracle
from mpi_helpers import JOBS, check, mpiexec, small_disk
from pipeline_helpers import FeatureSpec, batched_iterator
from shardrec.rank_runtime.process import lifecycle
from shardrec.rank_runtime import create_table, start_asc_pipeline
from shardrec.rank_runtime.embedding import tiers

sys.path.insert(0, JOBS)

ATOL = 1e-5


def train(out, ranks, tag, *args, timeout=300, wrapper=None):
    proc = mpiexec(ranks, "tier_train.py", "--out", out, "--tag", tag, *args, timeout=timeout, wrapper=wrapper)
    return proc


def results(out, tag, ranks):
    parts = [dict(np.load(out / f"{tag}-rank{r}-of{ranks}.npz")) for r in range(ranks)]
    counters = [json.load(open(out / f"{tag}-rank{r}-of{ranks}.json")) for r in range(ranks)]
    return parts, counters


def by_key(parts):
    """{key: (values, slot rows...)} over all ranks' exports; a key on two ranks fails."""
    out = {}
    for part in parts:
        names = sorted(n for n in part if n not in ("keys", "losses", "w", "eval_ids", "eval_rows"))
        for i, key in enumerate(part["keys"].tolist()):
            assert key not in out, f"key {key} is held by two ranks"
            out[key] = np.concatenate([part[n][i] for n in names])
    return out


def assert_same_rows(got, want):
    got, want = by_key(got), by_key(want)
    assert got.keys() == want.keys()
    worst = max(float(np.abs(got[k] - want[k]).max()) for k in want)
    assert worst <= ATOL, worst


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Every row in memory: plain tables (TensorFlow's initializer, no tier code), 1 and 2 ranks."""
    out = tmp_path_factory.mktemp("all_in_memory")
    for ranks in (1, 2):
        check(train(out, ranks, "ref", "--memory", 8000, "--init", "constant", "--eval"))
    return out


@pytest.mark.parametrize("ranks,memory", [(1, 640), (2, 700)])
def test_training_with_most_rows_on_ssd_equals_training_with_every_row_in_memory(reference, tmp_path, ranks, memory):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    check(train(tmp_path, ranks, "tier", "--memory", memory, "--ssd", 8000, "--ssd-path", ssd, "--init", "constant",
                "--eval"))
    got, counters = results(tmp_path, "tier", ranks)
    want, _ = results(reference, "ref", ranks)
    assert_same_rows(got, want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g["losses"], w["losses"], atol=ATOL)
        # Evaluation reads rows from both tiers (its batches are pinned on their own channel).
        np.testing.assert_array_equal(g["eval_ids"], w["eval_ids"])
        np.testing.assert_allclose(g["eval_rows"], w["eval_rows"], atol=ATOL)
    for c in counters:
        assert c["rows_on_ssd"] > c["rows_in_memory"], c
        assert c["swapped_in"] > 0 and c["ssd_hits"] == c["swapped_in"], c
        assert c["memory_hits"] + c["ssd_hits"] + c["misses"] >= c["keys_received"], c
        assert c["bytes_swapped_out"] == c["swapped_out"] * (16 + 3 * 4 * 8), c  # key, checksum, values, m, v
    assert os.listdir(ssd) == [], "a clean shutdown leaves nothing under ssd_data_path"


def test_keys_start_from_the_same_drawn_values_whatever_tier_or_rank_count_they_land_in(tmp_path):
    """A random initializer: an SSD-tier table draws each key's row from the key, so a run with a
    tiny memory tier and one with room for every key (no swap) end equal, on 1 and 2 ranks."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    check(train(tmp_path, 1, "roomy", "--memory", 8000, "--ssd", 100, "--ssd-path", ssd, "--optimizer", "adagrad"))
    check(train(tmp_path, 2, "tight", "--memory", 900, "--ssd", 8000, "--ssd-path", ssd, "--optimizer", "adagrad",
                "--prefetch", 4))
    roomy, c_roomy = results(tmp_path, "roomy", 1)
    tight, c_tight = results(tmp_path, "tight", 2)
    assert c_roomy[0]["swapped_out"] == 0 and all(c["swapped_in"] > 0 for c in c_tight)
    assert_same_rows(tight, roomy)


def test_a_checkpoint_holds_every_tier_and_restores_into_other_layouts_and_rank_counts(reference, tmp_path):
    """Saved at step 30 by 2 ranks with most rows on SSD; resumed by 1 rank with another memory
    budget, and by 2 ranks as a plain table: both end as the uninterrupted all-in-memory run."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    prefix = tmp_path / "ckpt" / "model"
    check(train(tmp_path, 2, "first", "--memory", 700, "--ssd", 8000, "--ssd-path", ssd, "--init", "constant",
                "--end", 30, "--save", prefix))
    _, counters = results(tmp_path, "first", 2)
    assert all(c["rows_on_ssd"] > 0 and c["swapped_in"] > 0 for c in counters), counters
    restore = f"{prefix}-30"
    check(train(tmp_path, 1, "resumed_tier", "--memory", 500, "--ssd", 8000, "--ssd-path", ssd, "--init", "constant",
                "--start", 30, "--restore", restore))
    check(train(tmp_path, 2, "resumed_plain", "--memory", 8000, "--init", "constant", "--start", 30,
                "--restore", restore))
    want, _ = results(reference, "ref", 1)
    assert_same_rows(results(tmp_path, "resumed_tier", 1)[0], want)
    assert_same_rows(results(tmp_path, "resumed_plain", 2)[0], results(reference, "ref", 2)[0])
    assert os.listdir(ssd) == []


def test_a_table_larger_than_the_memory_limit_trains_with_the_ssd_tier(tmp_path):
    """RLIMIT_DATA (the processes' private memory) at 1.4 GiB; 655,360 keys of dim 256 with lazy
    Adam's two slots are 2 GB of rows. Every row in memory fails; with the SSD tier it trains, saves
    and restores."""
    limit = 1400 * 2**20
    wrapper = ["prlimit", f"--data={limit}:{limit}"]
    common = ["--dim", 256, "--fresh", "--batch", 4096, "--end", 40, "--no-export", "--prefetch", 1]
    plain = train(tmp_path, 1, "plain", "--memory", 700_000, *common, wrapper=wrapper)
    assert plain.returncode != 0
    assert "Cannot allocate memory" in plain.stderr or "OOM" in plain.stderr, plain.stderr[-3000:]
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    tiers = ["--memory", 60_000, "--ssd", 700_000, "--ssd-path", ssd]
    prefix = tmp_path / "ckpt" / "model"
    check(train(tmp_path, 1, "tier", *tiers, *common, "--save", prefix, wrapper=wrapper))
    _, [c] = results(tmp_path, "tier", 1)
    row_bytes = 256 * 4 * 3 + 12
    assert c["size"] == 40 * 4096 * 4 and c["size"] * row_bytes > limit
    assert c["rows_on_ssd"] >= c["size"] - 60_000 and c["VmData"] < limit
    # The save and a restore in a fresh process stay under the same limit (a chunk of rows at a time).
    check(train(tmp_path, 1, "restored", *tiers, *common, "--start", 40, "--restore", f"{prefix}-40", wrapper=wrapper))
    _, [r] = results(tmp_path, "restored", 1)
    assert (r["size"], r["rows_on_ssd"]) == (c["size"], c["rows_on_ssd"]) and r["VmData"] < limit
    assert os.listdir(ssd) == []


def _sorted_export(parts):
    keys = np.concatenate([p["keys"] for p in parts])
    order = np.argsort(keys)
    names = sorted(n for n in parts[0] if n not in ("keys", "losses", "w", "eval_ids", "eval_rows"))
    return keys[order], {n: np.concatenate([p[n] for p in parts])[order] for n in names}


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_table_mostly_on_ssd_saves_and_restores_within_its_memory_budget(tmp_path, ranks):
    """Lazy Adam, dim 64, a memory budget of 20,000 rows a rank and over 10 times as many rows on
    SSD: the save, and the restore in a fresh process, peak at most max(10% of the budget's bytes,
    64 MB) above training's peak (they used to hold the whole table in memory); the restore's
    anonymous memory (heap, buffers: not the page cache it reads through) peaks within 10% of the
    budget's bytes above training's (its row files' chunks used to be 64 MiB, three side by side);
    and the restored rows, of both tiers, are exactly the saved ones."""
    budget, dim = 20_000, 64
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    prefix = tmp_path / "ckpt" / "model"
    common = ["--dim", dim, "--fresh", "--batch", 768 * ranks, "--prefetch", 1, "--memory", budget * ranks,
              "--ssd", 500_000 * ranks, "--ssd-path", ssd]
    check(train(tmp_path, ranks, "saved", *common, "--end", 100, "--save", prefix, timeout=600))
    check(train(tmp_path, ranks, "restored", *common, "--start", 100, "--end", 100, "--restore", f"{prefix}-100",
                timeout=600))
    saved, saved_counters = results(tmp_path, "saved", ranks)
    restored, restored_counters = results(tmp_path, "restored", ranks)
    allowance = max(budget * dim * 4 * 3 // 10, 64 * 2**20)
    for before, after in zip(saved_counters, restored_counters):
        assert before["rows_on_ssd"] >= 10 * budget, before
        assert after["rows_on_ssd"] == before["rows_on_ssd"], (before, after)
        assert before["peak_save"] <= before["peak_train"] + allowance, before
        assert after["peak_restore"] <= before["peak_train"] + allowance, (before, after)
        assert after["anon_peak_restore"] <= before["anon_peak_train"] + budget * dim * 4 * 3 // 10, (before, after)
    keys, rows = _sorted_export(saved)
    restored_keys, restored_rows = _sorted_export(restored)
    assert len(keys) == 100 * 768 * ranks * 4 and np.array_equal(restored_keys, keys)
    assert rows.keys() == restored_rows.keys() and len(rows) == 3
    for name in rows:
        np.testing.assert_array_equal(restored_rows[name], rows[name], err_msg=name)
    assert os.listdir(ssd) == []


def test_estimator_train_evaluate_predict_with_an_ssd_tier(tmp_path):
    """Graph modification and Estimator mode (a graph, and a table, for train, evaluate and predict
    in one process): evaluate and predict equal a Session-mode run over the same checkpoint."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    check(mpiexec(2, "estimator_flow.py", tmp_path / "model", tmp_path / "out", timeout=400,
                  env={"SSD_DIR": str(ssd), "EXPORT_DIR": str(tmp_path / "export")}))
    from estimator_flow import EVAL_ROWS, data
    from serving_helpers import serve, the_export

    for r in range(2):
        out = json.loads((tmp_path / f"out-rank{r}.json").read_text())
        assert out["metrics"]["auc"] == pytest.approx(out["session_auc"], abs=1e-5)
        np.testing.assert_allclose(out["pred_probs"], out["session_probs"], atol=1e-5)
        assert out["restored_keys"] > 2 * 220, "more keys than the memory tier: the rest restored to SSD"
        # Served from the SavedModel (rows of both tiers), by a process without shardrec.
        served = serve(the_export(tmp_path / "export"), data(EVAL_ROWS, 100 + r)[0], tmp_path)
        np.testing.assert_allclose(served["prob"], out["pred_probs"], atol=1e-5)
    assert os.listdir(ssd) == []


def test_a_full_disk_stops_every_rank_with_a_clear_error_and_keeps_the_last_checkpoint(tmp_path):
    """The only SSD path is a 40 MiB tmpfs: the third 16 MiB file does not fit. Both ranks stop in
    the same batch naming the directory; the checkpoint of step 30 restores and trains on exactly as
    a run that never filled a disk. With a second directory the table moves on to it."""
    small = tmp_path / "small"
    wrapper = small_disk(small, 40)
    big = tmp_path / "big"
    big.mkdir()
    prefix = tmp_path / "ckpt" / "model"
    common = ["--memory", 8000, "--ssd", 200_000, "--dim", 64, "--fresh", "--batch", 256, "--init", "constant"]
    try:
        proc = train(tmp_path, 2, "full", *common, "--ssd-path", small, "--end", 80, "--save", prefix,
                     "--save-every", 10, "--catch", wrapper=wrapper)
        check(proc)
        errors = [line for line in proc.stdout.splitlines() if line.startswith("TRAINING-ERROR")]
        assert len(errors) == 2, proc.stdout[-3000:]
        steps = {line.split()[2] for line in errors}
        assert len(steps) == 1, errors  # the same batch on every rank
        assert f"no directory of ssd_data_path [{small}] has room" in errors[0], errors
        assert "No space left on device" in errors[0] and "every rank stops here" in errors[0]
        stopped_at = int(steps.pop().rstrip(":").split("=")[1])
        assert 30 < stopped_at < 80
        last = (stopped_at // 10) * 10
        if wrapper is None:
            assert os.listdir(small) == []

        check(train(tmp_path, 2, "resumed", *common, "--ssd-path", big, "--start", last, "--end", last + 10,
                    "--restore", f"{prefix}-{last}"))
        check(train(tmp_path, 2, "straight", *common, "--ssd-path", big, "--end", last + 10))
        assert_same_rows(results(tmp_path, "resumed", 2)[0], results(tmp_path, "straight", 2)[0])

        check(train(tmp_path, 2, "spill", *common, "--ssd-path", small, big, "--end", last + 10, wrapper=wrapper))
        _, counters = results(tmp_path, "spill", 2)
        assert all(any(f.startswith(str(small)) for f in c["ssd_files"]) and
                   any(f.startswith(str(big)) for f in c["ssd_files"]) for c in counters), counters
        assert_same_rows(results(tmp_path, "spill", 2)[0], results(tmp_path, "straight", 2)[0])
    finally:
        if wrapper is None:
            subprocess.run(["umount", str(small)], check=False)


def test_a_save_to_a_full_disk_fails_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    """The checkpoint directory is a 6 MiB tmpfs: the save of step 10 (about 3 MB) fits, the one of
    step 20 (about 5 MB) does not. The native column writer's ENOSPC reaches every rank as one
    CheckpointError naming the rank(s) that met it; no half shard is left, and step 10 stays the latest and restores."""
    small = tmp_path / "small"
    wrapper = small_disk(small, 6)
    prefix = small / "model"
    common = ["--memory", 8000, "--dim", 64, "--fresh", "--init", "constant"]
    try:
        proc = train(tmp_path, 2, "full", *common, "--end", 20, "--save", prefix, "--save-every", 10, "--catch",
                     wrapper=wrapper)
        check(proc)
        errors = [line for line in proc.stdout.splitlines() if line.startswith("TRAINING-ERROR")]
        assert len(errors) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        # Both ranks share the small disk: whichever writes first may fit, so one or both fail; every
        # rank must hear the same list.
        failed = {re.search(r"failed on rank\(s\) (\[[0-9, ]+\])", line).group(1) for line in errors}
        assert len(failed) == 1 and failed.pop() in ("[0]", "[1]", "[0, 1]"), errors
        for line in errors:
            assert f"Saver.save('{prefix}-20') failed on rank(s) [" in line, line
            assert "No space left on device" in line and "the previous checkpoint stays the latest" in line, line
        if wrapper is None:  # the tmpfs outlives the job only when this process could mount it
            left = sorted(e for e in os.listdir(small) if "sparse-model-20" in e)
            assert not left, left  # the failed save is neither in place nor staged
            assert tf.train.latest_checkpoint(str(small)) == f"{prefix}-10"
            check(train(tmp_path, 2, "resumed", *common, "--start", 10, "--end", 10, "--restore", f"{prefix}-10"))
    finally:
        if wrapper is None:
            subprocess.run(["umount", str(small)], check=False)


def test_a_damaged_ssd_file_stops_every_rank_naming_the_file(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    proc = train(tmp_path, 2, "damaged", "--memory", 700, "--ssd", 8000, "--ssd-path", ssd, "--corrupt-at", 20, "--no-export",
                 "--catch")
    check(proc)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("TRAINING-ERROR")]
    assert len(errors) == 2 and len({line.split()[2] for line in errors}) == 1, proc.stdout[-3000:]
    assert f"SSD file {ssd}/shardrec-ssd-emb-rank" in errors[0] and "is damaged: record" in errors[0], errors[0]
    assert "restart from the last checkpoint" in errors[0] and "every rank stops here" in errors[0]


def test_admission_and_eviction_work_across_tiers(tmp_path):
    """The admission job's exact sets (admission_oracle.py) with a memory tier of 44 rows a rank."""
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    parts = admission_oracle.run_job(tmp_path, 2, "evict_steps", "--ssd", ssd, "--memory", 88, tag="tiers")
    admission_oracle.check_against_oracle(parts, "evict_steps", admission_oracle.STEP_EVICTIONS)
    assert sum(int(p["swapped"][1]) for p in parts) > 0, "rows moved to SSD"
    assert sum(int(p["swapped"][0]) for p in parts) > 0, "rows came back from SSD"


def test_files_of_a_process_that_no_longer_runs_are_removed(tmp_path, runtime):
    stale = tmp_path / "shardrec-ssd-t-rank0-pid999999999-0"
    stale.mkdir()
    (stale / "segment-0.ssd").write_bytes(b"x")
    other = tmp_path / f"shardrec-ssd-t-rank0-pid{os.getpid()}-0"
    table = create_table(tf.int64, 2, "t", tf.compat.v1.zeros_initializer(), device_vocabulary_size=8,
                         host_vocabulary_size=8, ssd_vocabulary_size=100, ssd_data_path=[str(tmp_path)])
    assert not stale.exists() and not other.exists()
    live = tmp_path / f"shardrec-ssd-t-rank0-pid{os.getpid()}-99"  # this process's: kept
    live.mkdir()
    tiers._remove_stale([str(tmp_path)], "t")
    assert live.exists()
    assert table.max_rows() == 16 + 100 and table.capacity() == 16


BAD_TIERS = [
    (dict(ssd_vocabulary_size=10, host_vocabulary_size=0), ValueError, "needs host_vocabulary_size > 0"),
    (dict(ssd_vocabulary_size=10, host_vocabulary_size=8, ssd_data_path=["/nonexistent/dir"]), ValueError,
     r"ssd_data_path entry '/nonexistent/dir' is not a directory"),
    (dict(ssd_vocabulary_size=10, host_vocabulary_size=8, ssd_data_path=[]), ValueError, "'ssd_data_path' is empty"),
    (dict(ssd_vocabulary_size=10, host_vocabulary_size=8, emb_initializer=tf.compat.v1.glorot_uniform_initializer()),
     ValueError, r"with an SSD tier, new rows are drawn by the native core"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_TIERS, ids=["no_host", "not_a_dir", "no_path", "initializer"])
def test_bad_tier_parameters_are_refused_naming_them(runtime, tmp_path, kwargs, error, match):
    kwargs = dict(dict(emb_initializer=tf.compat.v1.zeros_initializer(), device_vocabulary_size=8,
                       ssd_data_path=[str(tmp_path)]), **kwargs)
    with pytest.raises(error, match=match):
        create_table(tf.int64, 2, "t", **kwargs)


def test_host_tier_and_dynamic_expansion_are_exclusive(graph, tmp_path):
    lifecycle.init(use_dynamic_expansion=True)
    with pytest.raises(ValueError, match="host_vocabulary_size > 0 and dynamic expansion"):
        create_table(tf.int64, 2, "t", tf.compat.v1.zeros_initializer(), host_vocabulary_size=8)


def test_a_bad_swap_policy_is_refused(runtime, tmp_path, monkeypatch):
    monkeypatch.setenv(tiers.SWAP_POLICY_ENV, "fifo")
    with pytest.raises(ValueError, match="SHARDREC_SWAP_POLICY='fifo' is not a swap policy; allowed: 'lfu'"):
        create_table(tf.int64, 2, "t", tf.compat.v1.zeros_initializer(), host_vocabulary_size=8,
                     ssd_vocabulary_size=10, ssd_data_path=[str(tmp_path)])


def test_two_training_datasets_on_one_tiered_table_are_refused(runtime, tmp_path):
    create_table(tf.int64, 2, "t", tf.compat.v1.zeros_initializer(), device_vocabulary_size=64,
                 host_vocabulary_size=64, ssd_vocabulary_size=100, ssd_data_path=[str(tmp_path)])
    for name in ("a", "b"):
        batched_iterator({name: np.arange(8).reshape(4, 2)}, 2, [FeatureSpec(name, table_name="t")])
    with pytest.raises(ValueError, match="looked up by two train datasets"):
        start_asc_pipeline()


def test_a_memory_budget_below_two_batches_keys_stops_every_rank_naming_it(tmp_path):
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    proc = train(tmp_path, 2, "small", "--memory", 100, "--ssd", 8000, "--ssd-path", ssd, "--batch", 256, "--catch")
    check(proc)
    errors = [line for line in proc.stdout.splitlines() if line.startswith("TRAINING-ERROR")]
    assert len(errors) == 2 and "step=0" in errors[0], proc.stdout[-3000:]
    assert "its memory budget of 50 rows per rank" in errors[0], errors[0]
    assert "smaller than two batches' distinct keys" in errors[0] and "every rank stops here" in errors[0]
