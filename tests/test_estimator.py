"""Estimator mode under 2 real ranks: train -> evaluate -> predict, checked against a tf.Session
evaluation of the same checkpoint; and its errors."""
import glob
import sys
import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf

from mpi_helpers import JOBS, check, mpiexec

sys.path.insert(0, JOBS)


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


def test_a_step_limit_that_closes_one_ranks_session_before_its_prefetch_ends_the_pass_on_every_rank(flow, tmp_path):
    """Issue 75: max_steps stops training before the data ends, and rank 1's prefetch is held at the
    next batch until its session has closed, while rank 0's has begun that batch's key round. Rank
    1's close answers that round, which ends the pass on rank 0: without it rank 0's close waited for the
    round (the exchange's timeout) and rank 1 timed out in evaluate()'s first collective. The run
    ends as one without the hold: the same checkpoint, metrics and predictions."""
    proc = check(mpiexec(2, "estimator_flow.py", tmp_path / "model", tmp_path / "out", timeout=400,
                         env={"HOLD_PREFETCH_S": "60"}))
    # Rank 0's prefetch had begun batch 41; rank 1's close answered it.
    assert re.search(r"\[rank 0/2\] .* INFO shardrec.pipeline: train data: key exchange 'train' \(rank 0 of 2\): "
                     r"rank\(s\) 1 closed their session before beginning this round \(batch 41 ", proc.stderr), \
        proc.stderr[-3000:]
    _, plain = flow
    for r in range(2):
        held = json.loads((tmp_path / f"out-rank{r}.json").read_text())
        assert held["metrics"]["global_step"] == 40
        assert held["metrics"]["auc"] == pytest.approx(plain[r]["metrics"]["auc"], abs=1e-6)
        np.testing.assert_allclose(held["pred_probs"], plain[r]["pred_probs"], atol=1e-6)
        assert held["restored_keys"] == plain[r]["restored_keys"]


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
    from shardrec.rank_runtime import Estimator, create_table, sparse_lookup

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
    from shardrec.rank_runtime import Estimator

    with pytest.raises(RuntimeError, match="call init\\(\\) before creating the Estimator"):
        Estimator(lambda features, labels, mode: None)


def _reference_model_fn(use_shardrec):
    """Estimator_flow's model with SGD on the table and constant initial rows, so that plain
    TensorFlow (a dense tf.Variable indexed by id, its sparse gradient applied by
    GradientDescentOptimizer) is an exact oracle for shardrec's table."""
    from estimator_flow import DIM, FIELDS

    from mx_rec.optimizers import gradient_descent
    from shardrec.rank_runtime import create_table, sparse_lookup

    def model_fn(features, labels, mode):
        if use_shardrec:
            table = create_table(tf.int64, DIM, "emb", tf.compat.v1.constant_initializer(0.05),
                                 device_vocabulary_size=6000)
            emb = sparse_lookup(table, features["ids"], is_train=mode == tf.estimator.ModeKeys.TRAIN,
                                modify_graph=True)
            rows = table.variable
        else:
            rows = tf.compat.v1.get_variable("emb_dense", [FIELDS * 1000, DIM],
                                             initializer=tf.compat.v1.constant_initializer(0.05))
            emb = tf.nn.embedding_lookup(rows, features["ids"])
        with tf.compat.v1.variable_scope("tower"):
            h = tf.compat.v1.layers.dense(tf.concat([tf.reshape(emb, [-1, FIELDS * DIM]), features["x"]], 1), 16,
                                          tf.nn.relu, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=4))
            logit = tf.squeeze(tf.compat.v1.layers.dense(
                h, 1, kernel_initializer=tf.compat.v1.glorot_uniform_initializer(seed=5)), 1)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logit))
        if mode == tf.estimator.ModeKeys.EVAL:
            return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={
                "auc": tf.compat.v1.metrics.auc(labels, tf.sigmoid(logit))})
        step = tf.compat.v1.train.get_or_create_global_step()
        tower = tf.compat.v1.trainable_variables("tower")
        table_sgd = (gradient_descent.create_hash_optimizer(0.5) if use_shardrec
                     else tf.compat.v1.train.GradientDescentOptimizer(0.5))
        train_op = tf.group(
            tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(loss, var_list=tower, global_step=step),
            table_sgd.apply_gradients([(tf.gradients(loss, rows)[0], rows)]))
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    return model_fn


def test_estimator_training_matches_plain_tensorflow_and_learns(graph, tmp_path):
    from estimator_flow import input_fn

    from shardrec.rank_runtime import Estimator, init

    init()
    run_config = tf.estimator.RunConfig(tf_random_seed=1, save_checkpoints_steps=1000)
    ours = Estimator(_reference_model_fn(True), model_dir=str(tmp_path / "shardrec"), config=run_config)
    plain = tf.estimator.Estimator(_reference_model_fn(False), model_dir=str(tmp_path / "plain"), config=run_config)
    early = {}
    for name, est in (("shardrec", ours), ("plain", plain)):
        est.train(input_fn("train", 0), max_steps=2)
        early[name] = est.evaluate(input_fn("eval", 0))
        est.train(input_fn("train", 0), max_steps=40)  # the input starts again from its first batch
    early = early["plain"]
    # Evaluated on the training data: every key has a trained row in both (an unknown key reads
    # zeros in shardrec, its initial row in the plain model).
    got, want = ours.evaluate(input_fn("train", 0)), plain.evaluate(input_fn("train", 0))
    assert got["global_step"] == want["global_step"] == 40
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert got["auc"] == pytest.approx(want["auc"], abs=1e-4)
    assert plain.evaluate(input_fn("eval", 0))["auc"] > early["auc"] + 0.05, "training learns on held-out data"
    assert ours.evaluate(input_fn("eval", 0))["auc"] > early["auc"] + 0.05
    shard = tmp_path / "shardrec" / "sparse-model.ckpt-40" / "rank-0-of-1" / "emb"
    keys, values = np.load(shard / "keys.npy"), np.load(shard / "values.npy")
    reference = tf.train.load_checkpoint(str(tmp_path / "plain")).get_tensor("emb_dense")
    assert len(keys) > 100
    np.testing.assert_allclose(values, reference[keys], atol=1e-5)


def test_an_incremental_estimator_saves_deltas_and_evaluates_its_chain_exactly(graph, tmp_path):
    """init(is_incremental_checkpoint=True): the Estimator's checkpoint hook saves a full checkpoint
    and deltas by the timers, and evaluate() restores the chain's end: the same loss and AUC as plain
    TensorFlow trained alike."""
    import json

    from estimator_flow import input_fn

    from shardrec.rank_runtime import Estimator, init

    init(is_incremental_checkpoint=True, save_checkpoint_due_time=60, save_delta_checkpoints_secs=1)
    run_config = tf.estimator.RunConfig(tf_random_seed=1, save_checkpoints_steps=1000)
    ours = Estimator(_reference_model_fn(True), model_dir=str(tmp_path / "shardrec"), config=run_config)
    plain = tf.estimator.Estimator(_reference_model_fn(False), model_dir=str(tmp_path / "plain"), config=run_config)
    for est in (ours, plain):
        est.train(input_fn("train", 0), max_steps=40)
    manifests = sorted((tmp_path / "shardrec").glob("sparse-model.ckpt-*/rank-0-of-1/MANIFEST.json"))
    kinds = {json.loads(m.read_text())["step"]: json.loads(m.read_text())["kind"] for m in manifests}
    assert kinds[0] == "full" and kinds[40] == "delta" and list(kinds.values()).count("delta") >= 2, kinds
    got, want = ours.evaluate(input_fn("train", 0)), plain.evaluate(input_fn("train", 0))
    assert got["global_step"] == want["global_step"] == 40
    assert got["loss"] == pytest.approx(want["loss"], abs=1e-5)
    assert got["auc"] == pytest.approx(want["auc"], abs=1e-4)
