"""shardrec-serve's gRPC API, spoken to with tensorflow-serving-api's own stubs over a real channel:
status, metadata and health as TF Serving answers them; bad requests refused with TF Serving's codes
and a message naming what was wrong, the server unharmed; server-side batching that answers each
request with its own rows of one version, equal to unbatched answers and to a fresh export; and
what a key that a save holds but the job has not trained yet reads as, the same over REST, gRPC and
shardrec-export. (Every version against a fresh export, torn reads under live updates, faults:
tests/test_live_serving.py, whose servers speak gRPC too.)"""
import os
import threading

import grpc
import numpy as np
import pytest
import requests
import tensorflow as tf
from tensorflow_serving.apis import (get_model_metadata_pb2, get_model_status_pb2, model_service_pb2_grpc,
                                     prediction_service_pb2_grpc)

from live_chains import chains  # noqa: F401  (the fixture)
from live_chains import list_saves, oracle, probe_ids
from live_server import LiveServer, grpc_request, metric
from waits import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


def _stubs(server):
    channel = grpc.insecure_channel(server.grpc_target)
    return channel, prediction_service_pb2_grpc.PredictionServiceStub(channel), \
        model_service_pb2_grpc.ModelServiceStub(channel)


def _health(channel, service=""):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)


def _refused(call, *args):
    with pytest.raises(grpc.RpcError) as raised:
        call(*args, timeout=30)
    return raised.value.code(), raised.value.details()


def test_status_metadata_and_health_follow_the_versions_served(chains, tmp_path):
    """Before any checkpoint loads: health NOT_SERVING, status NOT_FOUND; once one is listed:
    SERVING, GetModelStatus AVAILABLE at its step, GetModelMetadata the SavedModel's signatures; a
    pinned version that is not served is NOT_FOUND."""
    model = tmp_path / "model"
    model.mkdir()
    server = LiveServer(chains["export"], model, "--grpc-port", "0")
    channel, predict, models = _stubs(server)
    try:
        assert _health(channel) == "NOT_SERVING" and _health(channel, "tensorflow.serving.PredictionService") == \
            "NOT_SERVING"
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = "model"
        code, details = _refused(models.GetModelStatus, request)
        assert code == grpc.StatusCode.NOT_FOUND and "no version is loaded yet" in details, details
        import shutil
        for name in os.listdir(chains[2]):
            if name.startswith(("model-4.", "sparse-model-4")):
                (shutil.copytree if name.startswith("sparse") else shutil.copy)(
                    os.path.join(chains[2], name), model / name)
        list_saves(model, [str(model / "model-4")])
        server.wait_version(4)
        wait_for(lambda: _health(channel) == "SERVING", None, 30, "health SERVING")
        status = models.GetModelStatus(request, timeout=10)
        assert [(s.version, s.state, s.status.error_code) for s in status.model_version_status] == \
            [(4, get_model_status_pb2.ModelVersionStatus.AVAILABLE, 0)]
        meta_request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        meta_request.model_spec.name = "model"
        meta = predict.GetModelMetadata(meta_request, timeout=10)
        assert meta.model_spec.version.value == 4
        defs = get_model_metadata_pb2.SignatureDefMap()
        assert meta.metadata["signature_def"].Unpack(defs)
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            saved = tf.compat.v1.saved_model.load(sess, [tf.saved_model.SERVING], chains["export"]).signature_def
        assert defs.signature_def["serving_default"] == saved["serving_default"]
        request.model_spec.version.value = 8
        code, details = _refused(models.GetModelStatus, request)
        assert code == grpc.StatusCode.NOT_FOUND and "Specific(model, 8)" in details, details
    finally:
        channel.close()
        server.stop()


def test_bad_requests_get_tf_serving_s_codes_naming_the_fault_and_the_next_request_is_served(chains, tmp_path):
    server = LiveServer(chains["export"], None, "--grpc-port", "0", "--max-body-mb", "0.01")
    channel, predict, _ = _stubs(server)
    ids = probe_ids([os.path.join(chains[2], "model-4")])[:5]
    good, _ = server.grpc_predict(ids, channel)
    wrong_length = grpc_request(ids)
    wrong_length.inputs["ids"].tensor_content = wrong_length.inputs["ids"].tensor_content[:-3]
    filtered = grpc_request(ids)
    filtered.output_filter.append("nope")
    labelled = grpc_request(ids)
    labelled.model_spec.version_label = "stable"
    # A few bytes that declare 2^40 ids (TensorFlow repeats a TensorProto's last value to its shape).
    huge = grpc_request(ids, inputs={"ids": np.array([7], np.int64)})
    huge.inputs["ids"].tensor_shape.dim[0].size = 2**40
    no_field = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["other"])
    no_field.model_spec.name = "model"
    C = grpc.StatusCode
    cases = [
        (C.NOT_FOUND, "Latest(other)", predict.Predict, grpc_request(ids, name="other")),
        (C.NOT_FOUND, "Specific(model, 7)", predict.Predict, grpc_request(ids, version=7)),
        (C.NOT_FOUND, "version label 'stable'", predict.Predict, labelled),
        (C.FAILED_PRECONDITION, "Serving signature key \"nope\" not found", predict.Predict,
         grpc_request(ids, signature="nope")),
        (C.INVALID_ARGUMENT, "input(s) ['ids'] of signature 'serving_default' missing", predict.Predict,
         grpc_request(ids, inputs={})),
        (C.INVALID_ARGUMENT, "alias(es) ['x'] not found", predict.Predict,
         grpc_request(ids, inputs={"ids": ids, "x": ids})),
        (C.INVALID_ARGUMENT, "input 'ids': expects int64, got int32", predict.Predict,
         grpc_request(ids, inputs={"ids": ids.astype(np.int32)})),
        (C.INVALID_ARGUMENT, "input 'ids': shape [5, 1] does not match the signature's [-1]", predict.Predict,
         grpc_request(ids, inputs={"ids": ids[:, None]})),
        (C.INVALID_ARGUMENT, "input 'ids': the TensorProto does not hold a int64 tensor", predict.Predict,
         wrong_length),
        (C.INVALID_ARGUMENT, "output_filter names ['nope']", predict.Predict, filtered),
        (C.INVALID_ARGUMENT, "the one field served is ['signature_def']", predict.GetModelMetadata, no_field),
        (C.RESOURCE_EXHAUSTED, "", predict.Predict, grpc_request(np.arange(5000, dtype=np.int64))),
        (C.RESOURCE_EXHAUSTED, "input 'ids': shape [1099511627776] of int64", predict.Predict, huge),
    ]
    try:
        for code, message, call, request in cases:
            got, details = _refused(call, request)
            assert got == code and message in details, (code, message, got, details)
            assert "Traceback" not in details
            again, _ = server.grpc_predict(ids, channel)  # the server unharmed
            np.testing.assert_array_equal(again["emb"], good["emb"])
        # Bytes that are not a PredictRequest at all, sent on the method's path.
        raw = channel.unary_unary("/tensorflow.serving.PredictionService/Predict")
        got, details = _refused(raw, b"\xff\xff\xff\xff not a proto")
        assert got == C.INVALID_ARGUMENT and "not a tensorflow.serving.PredictRequest" in details, details
        np.testing.assert_array_equal(server.grpc_predict(ids, channel)[0]["emb"], good["emb"])
        assert metric(server, "shardrec_serve_requests_total") >= 0
        text = requests.get(f"{server.url}/metrics", timeout=10).text
        assert 'api="grpc",code="INVALID_ARGUMENT",endpoint="predict"' in text, text
    finally:
        channel.close()
        server.stop()
    assert "Traceback" not in server.log, server.log


def _batched_export(checkpoint, out):
    from live_serving_model import batched_outputs
    from shardrec.rank_runtime import export_saved_model

    export_saved_model(str(checkpoint), str(out), batched_outputs, {"ids": tf.TensorSpec([None], tf.int64)})
    return str(out)


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(chains, tmp_path):
    """12 threads, each sending 10 requests of its own ids (1 to 40 of them, a request larger than
    --max-batch-size among them), over REST and gRPC at once, to a server that waits up to 50 ms for
    a batch to fill: batches of several requests run (the metric), and every answer equals the
    unbatched answer of the same ids and the export's. The unbatched server runs each request's ops
    in the request's own thread, one thread an op; the batching one on TensorFlow's pools."""
    checkpoint = os.path.join(chains[2], "model-4")
    export = _batched_export(checkpoint, tmp_path / "batched")
    pool = probe_ids([checkpoint])
    rng = np.random.default_rng(7)
    asks = [[rng.choice(pool, size=int(rng.integers(1, 41))) for _ in range(10)] for _ in range(12)]
    asks[0][0] = rng.choice(pool, size=70)  # over --max-batch-size 64: runs alone
    plain = LiveServer(export, None, "--grpc-port", "0", "--tensorflow-inter-op-parallelism", "-1",
                       "--tensorflow-intra-op-parallelism", "1")
    try:
        want = {(t, i): plain.grpc_predict(ids)[0] for t, row in enumerate(asks) for i, ids in enumerate(row)}
    finally:
        plain.stop()
    server = LiveServer(export, None, "--grpc-port", "0", "--enable-batching", "--max-batch-size", "64",
                        "--batch-timeout-micros", "50000", "--num-batch-threads", "2")
    got, errors = {}, []

    def client(t):
        channel = grpc.insecure_channel(server.grpc_target)
        session = requests.Session()
        try:
            for i, ids in enumerate(asks[t]):
                if t % 2:
                    got[(t, i)] = server.grpc_predict(ids, channel)[0]
                else:
                    out = server.predict(ids, session)[0]
                    got[(t, i)] = {k: np.asarray(v, np.float32) for k, v in out.items()}
        except Exception as e:  # kept for the assertion below
            errors.append(repr(e))
        finally:
            channel.close()

    try:
        threads = [threading.Thread(target=client, args=(t,)) for t in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        text = requests.get(f"{server.url}/metrics", timeout=10).text
    finally:
        server.stop()
    assert not errors, errors
    assert "batching signatures ['serving_default']" in server.log, server.log
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels
               or s.labels.get("le") is None}
    batches, requests_in = samples["shardrec_serve_batch_requests_count"], samples["shardrec_serve_batch_requests_sum"]
    assert requests_in == 120 and batches < 100, (batches, requests_in)  # batches of several requests ran
    oracle_out = oracle(checkpoint, tmp_path, pool)
    by_key = {k: row for k, row in zip(pool.tolist(), oracle_out["emb"])}
    for key, out in want.items():
        t, i = key
        np.testing.assert_array_equal(got[key]["emb"], out["emb"], err_msg=f"thread {t}, request {i}")
        np.testing.assert_array_equal(got[key]["score"], out["score"], err_msg=f"thread {t}, request {i}")
        np.testing.assert_array_equal(out["emb"], np.stack([by_key[k] for k in asks[t][i].tolist()]))


def test_a_key_saved_before_its_first_step_reads_its_initial_row_over_rest_grpc_and_the_export(tmp_path):
    """A job reads batches ahead of its step (its dataset's prefetch and the key pipeline): its save
    after step 3 holds the keys of later batches too, at their initial (random) rows. Served, such
    a key reads that initial row, as the job's own lookup would at that step: over REST, over gRPC
    and in a fresh load of shardrec-export, alike, bit for bit the save's; a key the save does not
    hold reads zeros."""
    from live_chains import export
    from mpi_helpers import check, mpiexec
    from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows

    model = tmp_path / "model"
    check(mpiexec(1, "read_ahead_job.py", model, "--steps", "3"))
    checkpoint = str(model / "model-3")
    rows = table_rows(find_checkpoints(checkpoint)[0], "emb")
    ahead = rows["keys"] >= 3 * 100  # read_ahead_job: step s brings keys 100*s .. 100*s+99
    assert ahead.sum() >= 1 and (~ahead).sum() == 300, rows["keys"]
    saved = dict(zip(rows["keys"].tolist(), rows["values"]))
    unknown = np.array([10**12], np.int64)
    ids = np.concatenate([rows["keys"][ahead][:50], rows["keys"][~ahead][:5], unknown])
    expected = np.stack([saved.get(k, np.zeros(4, np.float32)) for k in ids.tolist()])
    assert (expected[:50] != 0).all()  # random initial rows: not what an unknown key reads
    server = LiveServer(export(checkpoint, tmp_path / "export"), model, "--grpc-port", "0")
    try:
        server.wait_version(3)
        rest, _ = server.predict(ids)
        over_grpc, _ = server.grpc_predict(ids)
    finally:
        server.stop()
    exported = oracle(checkpoint, tmp_path, ids)
    for name, emb in (("REST", rest["emb"]), ("gRPC", over_grpc["emb"]), ("the export", exported["emb"])):
        np.testing.assert_array_equal(emb, expected, err_msg=name)
