"""Serving: a model trained on 2 ranks, exported as a SavedModel of stock TensorFlow ops and served
by a process that imports TensorFlow only (serving_helpers.serve), against the training job's own
predictions and the checkpoint's rows."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from mpi_helpers import JOBS, check, mpiexec
from serving_helpers import serve, the_export

sys.path.insert(0, JOBS)

RECEIVER = {"ids": tf.TensorSpec([None, 5], tf.int64), "x": tf.TensorSpec([None, 3], tf.float32),
            "row": tf.TensorSpec([None], tf.int64)}
SESSION_INPUTS = {k: v for k, v in RECEIVER.items() if k != "row"}  # serving_outputs does not return it
UNSEEN = 10**12  # no key of estimator_flow's data is this large


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """estimator_flow on 2 ranks; rank 0 exports with Estimator.export_saved_model at the end."""
    d = tmp_path_factory.mktemp("serving")
    check(mpiexec(2, "estimator_flow.py", d / "model", d / "out", timeout=400,
                  env={"EXPORT_DIR": str(d / "estimator_export")}))
    return d, [json.loads((d / f"out-rank{r}.json").read_text()) for r in range(2)]


def _held_out(rank):
    from estimator_flow import EVAL_ROWS, data

    features, _ = data(EVAL_ROWS, 100 + rank)
    return features


def _checkpoint_rows(checkpoint):
    """key -> row of the table 'emb', every rank's shard, read by the checkpoint tool's reader."""
    from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows

    rows = table_rows(find_checkpoints(checkpoint)[0], "emb")
    return dict(zip(rows["keys"].tolist(), rows["values"]))


def test_an_estimator_export_predicts_what_the_training_job_predicted_without_shardrec(trained, tmp_path):
    d, ranks = trained
    export = the_export(d / "estimator_export")
    assert os.path.getsize(os.path.join(export, "saved_model.pb")) < 200_000, "rows are variables, not constants"
    for rank, out in enumerate(ranks):
        served = serve(export, _held_out(rank), tmp_path)
        np.testing.assert_allclose(served["prob"], out["pred_probs"], atol=1e-5)
        np.testing.assert_array_equal(served["row"], out["pred_rows"])


def test_a_session_mode_export_serves_the_checkpoint_s_rows_and_zeros_for_unseen_keys(trained, tmp_path):
    from estimator_flow import serving_outputs

    from shardrec.rank_runtime.serving.export import export_saved_model

    d, ranks = trained
    checkpoint = ranks[0]["checkpoint"]
    summary = export_saved_model(str(d / "model"), str(tmp_path / "session_export"), serving_outputs, SESSION_INPUTS)
    assert summary.checkpoint == checkpoint
    assert [(t.name, t.dim) for t in summary.tables] == [("emb", 8)]
    rows = _checkpoint_rows(checkpoint)
    assert summary.tables[0].rows == len(rows)
    features = _held_out(1)
    del features["row"]
    features["ids"][:3] = UNSEEN + np.arange(15).reshape(3, 5)  # three samples of unseen ids
    served = serve(tmp_path / "session_export", features, tmp_path)
    emb = served["emb"]
    assert emb.shape == (len(features["ids"]), 5, 8)
    np.testing.assert_array_equal(emb[:3], 0.0)
    for sample, ids in enumerate(features["ids"][3:], start=3):
        for field, key in enumerate(ids):
            want = rows.get(int(key), np.zeros(8, np.float32))
            np.testing.assert_array_equal(emb[sample, field], want, err_msg=f"key {key}")
    np.testing.assert_allclose(served["prob"][3:], ranks[1]["pred_probs"][3:], atol=1e-5)


def test_the_export_command_writes_what_saved_model_cli_shows(trained, tmp_path):
    d, ranks = trained
    out = tmp_path / "cli_export"
    bin_dir = os.path.dirname(sys.executable)
    args = [os.path.join(bin_dir, "shardrec-export"), str(d / "model"), "--out", str(out),
            "--model-fn", os.path.join(JOBS, "estimator_flow.py") + ":model_fn",
            "--feature", "ids=int64[-1,5]", "--feature", "x=float32[-1,3]", "--feature", "row=int64[-1]"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "table emb: " in done.stdout and "signature serving_default" in done.stdout
    np.testing.assert_allclose(serve(out, _held_out(0), tmp_path)["prob"], ranks[0]["pred_probs"], atol=1e-5)
    shown = subprocess.run([os.path.join(bin_dir, "saved_model_cli"), "show", "--dir", str(out), "--all"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    for name, dtype, shape in (("ids", "DT_INT64", "(-1, 5)"), ("x", "DT_FLOAT", "(-1, 3)"), ("row", "DT_INT64", "(-1)")):
        assert f"inputs['{name}'] tensor_info:\n        dtype: {dtype}\n        shape: {shape}" in shown.stdout, shown.stdout
    again = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 2 and "exists" in again.stderr and "--overwrite" in again.stderr


def test_a_job_restored_into_one_rank_predicts_and_exports_the_same(trained, tmp_path):
    d, ranks = trained
    shutil.copytree(d / "model", tmp_path / "model")
    # One rank, the 2-rank checkpoint at its last step: nothing left to train, predict restores it.
    check(mpiexec(1, "estimator_flow.py", tmp_path / "model", tmp_path / "out", timeout=400,
                  env={"EXPORT_DIR": str(tmp_path / "export")}))
    one = json.loads((tmp_path / "out-rank0.json").read_text())
    assert one["size"] == 1 and one["checkpoint"] == ranks[0]["checkpoint"].replace(str(d), str(tmp_path))
    np.testing.assert_allclose(one["pred_probs"], ranks[0]["pred_probs"], atol=1e-5)
    served = serve(the_export(tmp_path / "export"), _held_out(0), tmp_path)
    np.testing.assert_allclose(served["prob"], ranks[0]["pred_probs"], atol=1e-5)


def test_an_export_refuses_an_existing_directory_a_damaged_checkpoint_and_an_unknown_feature(trained, tmp_path):
    from estimator_flow import serving_outputs

    from shardrec.rank_runtime.formats import sparse_checkpoint as fmt
    from shardrec.rank_runtime.serving.export import export_saved_model

    d, ranks = trained
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(FileExistsError, match="exists; choose a new directory, or pass overwrite=True"):
        export_saved_model(str(d / "model"), str(existing), serving_outputs, SESSION_INPUTS)
    assert os.listdir(existing) == []

    extra = dict(SESSION_INPUTS, clicks=tf.TensorSpec([None], tf.int64))
    with pytest.raises(ValueError, match=r"input feature\(s\) \['clicks'\] are not used by the model"):
        export_saved_model(str(d / "model"), str(tmp_path / "extra"), serving_outputs, extra)
    assert not (tmp_path / "extra").exists()

    shutil.copytree(d / "model", tmp_path / "model")
    checkpoint = ranks[0]["checkpoint"].replace(str(d), str(tmp_path))
    shard = os.path.join(fmt.sparse_dir(checkpoint), fmt.shard_name(1, 2))
    values = os.path.join(shard, fmt.read_manifest(shard).tables["emb"].files["values"].file)
    with open(values, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(fmt.CheckpointError, match="checksum mismatch .*table 'emb' values.*corrupt"):
        export_saved_model(checkpoint, str(tmp_path / "damaged"), serving_outputs, SESSION_INPUTS)
    assert not (tmp_path / "damaged").exists()
    assert [e for e in os.listdir(tmp_path) if e.startswith(".damaged")] == [], "no half-written export left"


def test_the_session_mode_demo_exports_a_model_that_serves_its_own_evaluation(tmp_path):
    """examples/wide_deep.py (tf.Session mode, FeatureSpec lookups, two tables over one id tensor)
    on 2 ranks with --export: the served model predicts each rank's held-out samples as the job's
    own evaluation did; then the same checkpoint through shardrec-export with the demo's function."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "examples"))
    import criteo_synth

    demo = os.path.join(root, "examples", "wide_deep.py")
    check(mpiexec(2, demo, "--steps", "40", "--batch-size", "128", "--eval-samples", "1024", "--model-dir",
                  tmp_path / "model", "--export", tmp_path / "export", "--eval-predictions", tmp_path / "eval",
                  timeout=400))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    cli = subprocess.run([os.path.join(os.path.dirname(sys.executable), "shardrec-export"), str(tmp_path / "model"),
                          "--out", str(tmp_path / "cli"), "--model-fn", demo + ":serving_model",
                          "--feature", "cat=int64[-1,26]", "--feature", "dense=float32[-1,13]"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    for rank in range(2):
        held_out = criteo_synth.make_dataset(1024, seed=2024, sample_seed=2024 * 31 + 10_000 + rank)
        features = {"cat": held_out["cat"], "dense": held_out["dense"]}
        want = np.load(tmp_path / f"eval-rank{rank}.npy")
        for export in ("export", "cli"):
            np.testing.assert_allclose(serve(tmp_path / export, features, tmp_path)["prob"], want, atol=1e-5,
                                       err_msg=f"{export}, rank {rank}")


def test_an_estimator_export_names_a_receiver_feature_the_model_does_not_read(trained, runtime, tmp_path):
    from estimator_flow import model_fn, serving_receiver

    from shardrec.rank_runtime import Estimator

    d, _ = trained

    def receiver():
        plain = serving_receiver()
        features = dict(plain.features, clicks=tf.compat.v1.placeholder(tf.int64, [None], name="clicks"))
        return tf.estimator.export.ServingInputReceiver(features, features)

    with pytest.raises(ValueError, match=r"receiver's feature\(s\) \['clicks'\] are not used by the model"):
        Estimator(model_fn, model_dir=str(d / "model")).export_saved_model(str(tmp_path / "exports"), receiver)
    assert not (tmp_path / "exports").exists() or os.listdir(tmp_path / "exports") == []


def test_an_export_graph_and_a_training_graph_built_at_once_each_keep_their_tables(trained, runtime):
    """An export names the graph it builds: there create_table and sparse_lookup make stock ops
    from the checkpoint; in a training graph built meanwhile they make a trained shard, as ever."""
    from shardrec.rank_runtime.embedding.table import EmbeddingTable, create_table
    from shardrec.rank_runtime.pipeline.lookup import sparse_lookup
    from shardrec.rank_runtime.serving.export import export_in
    from shardrec.rank_runtime.serving.stock_table import StockTable

    _, ranks = trained
    export_graph = tf.Graph()
    export_in(export_graph, ranks[0]["checkpoint"])
    with export_graph.as_default():
        stock = create_table(tf.int64, 8, "emb", tf.compat.v1.zeros_initializer())
    trained_table = create_table(tf.int64, 8, "emb", tf.compat.v1.zeros_initializer())  # the runtime's graph
    with export_graph.as_default():
        rows = sparse_lookup(stock, tf.compat.v1.placeholder(tf.int64, [None, 5]), name="served")
    assert type(stock) is StockTable and type(trained_table) is EmbeddingTable
    assert rows.shape.as_list() == [None, 5, 8]
    assert not [op.type for op in export_graph.get_operations() if "shardrec" in op.type.lower()]
    with pytest.raises(RuntimeError, match="already an export's"):
        export_in(export_graph, ranks[0]["checkpoint"])
