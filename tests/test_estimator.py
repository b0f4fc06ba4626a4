"""Estimator mode under 2 real ranks: train -> evaluate -> predict, checked against a tf.Session
evaluation of the same checkpoint; and its errors."""
import glob
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from mpi_helpers import check, mpiexec


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    d = tmp_path_factory.mktemp("estimator")
    check(mpiexec(2, "estimator_flow.py", d / "model", d / "out", timeout=400))
    return d, [json.loads((d / f"out-rank{r}.json").read_text()) for r in range(2)]


def test_evaluate_matches_a_session_evaluation_of_the_same_checkpoint(flow):
    d, ranks = flow
    for out in ranks:
        assert out["checkpoint"] == str(d / "model" / "model.ckpt-40")
        assert out["metrics"]["global_step"] == 40
        assert out["metrics"]["auc"] == pytest.approx(out["session_auc"], abs=1e-5)
        assert out["restored_keys"] > 0
    # The ranks evaluate different data, so their AUCs are their own.
    assert ranks[0]["session_auc"] != ranks[1]["session_auc"]


def test_predict_returns_one_prediction_per_row_in_order(flow):
    _, ranks = flow
    for out in ranks:
        assert out["pred_rows"] == list(range(256))
        np.testing.assert_allclose(out["pred_probs"], out["session_probs"], atol=1e-5)


def test_rank0_writes_dense_and_summaries_every_rank_its_shards(flow):
    d, _ = flow
    model = d / "model"
    for step in (0, 15, 30, 40):
        assert (model / f"model.ckpt-{step}.index").exists()
        shards = sorted(os.listdir(model / f"sparse-model.ckpt-{step}"))
        assert shards == ["rank-0-of-2", "rank-1-of-2"], shards
    assert len(glob.glob(str(model / "events.out.tfevents*"))) == 1, "only rank 0 writes training summaries"
    names = [n for n, _ in tf.train.list_variables(str(model / "model.ckpt-40"))]
    assert "emb" not in names and not any(n.startswith("emb/") for n in names), "tables are not in the dense part"


def test_table_created_outside_model_fn_is_a_clear_error(runtime, tmp_path):
    from rank_runtime import Estimator, create_table, sparse_lookup

    outside = create_table(tf.int64, 4, "outside", tf.compat.v1.zeros_initializer(), device_vocabulary_size=10)

    def model_fn(features, labels, mode):
        emb = sparse_lookup(outside, features["ids"], modify_graph=True)
        loss = tf.reduce_sum(emb)
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=tf.no_op())

    def input_fn():
        return tf.data.Dataset.from_tensors(({"ids": tf.constant([[1, 2]], tf.int64)}, tf.constant([1.0])))

    est = Estimator(model_fn, model_dir=str(tmp_path))
    with pytest.raises(ValueError, match="'outside' was created in another TensorFlow graph.*inside model_fn"):
        est.train(input_fn, max_steps=1)


def test_estimator_needs_init(graph):
    from rank_runtime import Estimator

    with pytest.raises(RuntimeError, match="call init\\(\\) before creating the Estimator"):
        Estimator(lambda features, labels, mode: None)
