"""A checkpoint written by an earlier release still reads the same. tests/data/format-1/ keeps a
chain of 2 ranks (a full save at step 4, deltas at 8 and 12: admission counts, timestamps, pending
keys, evicted keys, lazy Adam's slots) and what 2 ranks held after restoring it then (its README
says how it was made). Today's readers, the typed manifest, shardrec-ckpt, the TensorFlow-free
table reader and the Saver's restore into 1 and 2 ranks, must read exactly that."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from mpi_helpers import check, mpiexec
from incremental_helpers import JOB, assert_same, gathered

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "format-1")


@pytest.fixture
def kept(tmp_path):
    """A copy of the kept checkpoint (a test never writes into the repository's)."""
    return shutil.copytree(os.path.join(DATA, "checkpoint"), tmp_path / "kept")


def test_every_manifest_reads_as_its_types_with_the_chain_it_names(kept):
    from shardrec.rank_runtime.formats.manifest import DELTA, FULL, SHARED
    from shardrec.rank_runtime.formats.sparse_checkpoint import read_manifest, shard_name, sparse_dir

    ids = {}
    for step, kind in ((4, FULL), (8, DELTA), (12, DELTA)):
        for rank in range(2):
            m = read_manifest(os.path.join(sparse_dir(str(kept / f"model-{step}")), shard_name(rank, 2)))
            assert (m.step, m.rank, m.world_size, m.kind, m.layout) == (step, rank, 2, kind, SHARED)
            ids.setdefault(step, set()).add(m.save_id)
            table = m.tables["emb"]
            assert (table.dim, table.key_dtype, table.slots) == (4, "int64", ["LazyAdam.m", "LazyAdam.v"])
            assert table.admission is not None and table.admission.access_threshold == 2
            assert table.files["keys"].rows == table.rows and table.files["values"].shape == (table.rows, 4)
            if kind == DELTA:
                assert (m.previous.name, m.previous.step, m.base.name) == (f"model-{step - 4}", step - 4, "model-4")
                assert m.previous.save_id in ids[step - 4] and m.base.save_id in ids[4]
                assert table.removed_rows == table.files["removed"].rows
    assert all(len(s) == 1 for s in ids.values()) and len(set.union(*ids.values())) == 3


@pytest.mark.parametrize("change,message", [
    (lambda m: m["tables"]["emb"].update(rows="27"), r"the manifest\.tables\.emb's 'rows' is '27'; a manifest has int there"),
    (lambda m: m["tables"]["emb"]["files"]["keys"].pop("crc32"), r"the manifest\.tables\.emb\.files\.keys has no 'crc32'"),
    (lambda m: m.pop("previous"), r"the manifest has no 'previous'"),
    (lambda m: m.update(kind="partial"), r"the manifest's kind 'partial' is neither 'full' nor 'delta'"),
], ids=["wrong_type", "missing_key", "delta_without_previous", "unknown_kind"])
def test_a_damaged_manifest_is_refused_naming_the_file_and_the_key(kept, change, message):
    import json

    from shardrec.rank_runtime.formats.sparse_checkpoint import CheckpointError, read_manifest

    shard = kept / "sparse-model-8" / "rank-0-of-2"
    content = json.loads((shard / "MANIFEST.json").read_text())
    change(content)
    (shard / "MANIFEST.json").write_text(json.dumps(content))
    with pytest.raises(CheckpointError, match=r"rank-0-of-2/MANIFEST.json: " + message):
        read_manifest(str(shard))


def test_shardrec_ckpt_finds_the_chain_complete(kept):
    cli = os.path.join(os.path.dirname(sys.executable), "shardrec-ckpt")
    proc = subprocess.run([cli, "inspect", str(kept)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("model-4: step 4, world size 2, OK", "model-8: step 8, delta on model-4, world size 2, OK",
                 "model-12: step 12, delta on model-8, world size 2, OK"):
        assert line in proc.stdout, proc.stdout


def test_the_table_reader_without_tensorflow_reads_the_restored_rows(kept):
    from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows

    for i, step in enumerate((12, 4)):
        want = gathered(DATA, f"expected-{i}", 2)
        got = table_rows(find_checkpoints(str(kept / f"model-{step}"))[0], "emb")
        order = np.argsort(got["keys"])
        np.testing.assert_array_equal(got["keys"][order], want["keys"])
        for name, column in (("values", "values"), ("LazyAdam.m", "LazyAdam_m"), ("LazyAdam.v", "LazyAdam_v"),
                             ("counts", "counts"), ("last_seen", "last_seen")):
            np.testing.assert_array_equal(got[name][order], want[column], err_msg=f"step {step} {name}")
        by = np.argsort(got["pending_keys"])
        np.testing.assert_array_equal(got["pending_keys"][by], want["pending"][0])


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_saver_restores_what_the_release_that_wrote_it_restored(kept, tmp_path, ranks):
    check(mpiexec(ranks, JOB, tmp_path, "restore", "--paths", f"{kept}/model-12,{kept}/model-4", "--tag", "now"))
    for i in range(2):
        assert_same(gathered(str(tmp_path), f"now-{i}", ranks), gathered(DATA, f"expected-{i}", 2), f"restore {i}")
