"""shardrec-serve following a training job's model directory: every version it serves equals a fresh
`tf.saved_model.load` of shardrec-export on that version's checkpoint (rows bitwise), whichever world
size saved it; no request sees part of an update; damaged, incomplete and broken saves are refused by
name with the version served kept; a restarted server comes back at the newest complete checkpoint;
TF Serving's REST API and its errors, over real HTTP."""
import json
import os
import re
import shutil
import signal
import sys

import numpy as np
import pytest
import requests
import tensorflow as tf

from live_chains import STEPS, chains  # noqa: F401  (the fixture)
from live_chains import list_saves as _list
from live_chains import oracle as _oracle
from live_chains import probe_ids as _probe_ids
from live_server import Clients, LiveServer, metric
from waits import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
POLLS = "shardrec_serve_model_dir_polls_total"


def _assert_serves(server, checkpoint, ids, work):
    """REST's answer (and gRPC's, when the server speaks it: the same arrays bit for bit) equals a
    fresh load of shardrec-export on `checkpoint`."""
    got, version = server.predict(ids)
    want = _oracle(checkpoint, work, ids)
    assert version == int(checkpoint.rsplit("-", 1)[1])
    np.testing.assert_array_equal(got["emb"], want["emb"], err_msg=f"version {version}: rows")
    np.testing.assert_array_equal(got["w"], want["w"], err_msg=f"version {version}: dense w")
    np.testing.assert_allclose(got["score"], want["score"], rtol=0, atol=1e-6, err_msg=f"version {version}: predictions")
    if server.grpc_target is not None:
        over_grpc, grpc_version = server.grpc_predict(ids)
        assert grpc_version == version and set(over_grpc) == set(got)
        for name, value in over_grpc.items():
            np.testing.assert_array_equal(value, got[name], err_msg=f"version {version}: gRPC's {name} against REST's")
    return got


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)])
def test_every_version_equals_a_fresh_export_of_its_checkpoint_across_a_change_of_world_size(
        chains, tmp_path, first, then):
    """Saves 4, 8, 12 by `first` ranks, then 16, 20, 24 by `then` ranks (a job resized between them):
    each delta applied in place, each full save loaded beside and swapped in."""
    follow = tmp_path / "model"
    follow.mkdir()
    paths = []
    for step in STEPS:
        source = chains[first if step < 16 else then]
        for name in (f"model-{step}.index", f"model-{step}.data-00000-of-00001", f"model-{step}.meta",
                     f"sparse-model-{step}"):
            copy = shutil.copytree if name.startswith("sparse") else shutil.copy
            copy(os.path.join(source, name), follow / name)
        paths.append(str(follow / f"model-{step}"))
    ids = _probe_ids(paths)
    _list(follow, paths[:1])
    server = LiveServer(chains["export"], follow, "--grpc-port", "0")
    try:
        seen = []
        for i, path in enumerate(paths):
            _list(follow, paths[:i + 1])
            assert server.wait_version(STEPS[i]) == STEPS[i]  # each is listed once the one before is served
            got = _assert_serves(server, path, ids, tmp_path)
            seen.append(got["emb"])
        log = server.log
        families = _metrics_as_the_docs_list_them(server)
        assert families["shardrec_serve_model_version"][0].value == STEPS[-1]
        updates = {s.labels["how"]: s.value for s in families["shardrec_serve_updates_total"]
                   if s.name == "shardrec_serve_updates_total"}
        assert updates["delta"] >= 1 and updates["full"] >= 1, updates
        shardrec = server.status()["shardrec"]
        assert shardrec["checkpoint"] == f"model-{STEPS[-1]}" and shardrec["committed_at"] <= shardrec["served_at"]
    finally:
        server.stop()
    assert "a delta applied in place" in log and "loaded whole" in log, log
    # The probe set has keys that gained, lost (evicted) and never had a row between versions.
    rows = np.stack(seen)
    zero = ~rows.any(axis=2)
    assert (zero[0] & ~zero[-1]).any() and (~zero[0] & zero[-1]).any() and zero[:, -2:].all()


def _metrics_as_the_docs_list_them(server) -> dict:
    """The server's /metrics, parsed by prometheus_client, checked against the table of
    docs/guide/serving.md: the same metrics, each of the type and with the labels it says. Returns
    the samples of each metric by its documented name."""
    from prometheus_client.parser import text_string_to_metric_families

    guide = open(os.path.join(os.path.dirname(HERE), "docs", "guide", "serving.md"), encoding="utf-8").read()
    documented = {name: (kind, set(re.findall(r"`(\w+)`", labels))) for name, kind, labels in
                  re.findall(r"^ *\| `(shardrec_serve_\w+)` \| (\w+) \|([^|]*)\|", guide, re.M)}
    assert len(documented) >= 8, documented
    served, samples = {}, {}
    for family in text_string_to_metric_families(requests.get(f"{server.url}/metrics", timeout=10).text):
        if family.name.endswith("_created"):  # the time a counter's or histogram's series began
            base = family.name[:-len("_created")]
            assert documented.get(base + "_total", documented.get(base, ("",)))[0] in ("counter", "histogram"), base
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for sample in family.samples for k in sample.labels if k != "le"}
        served[name], samples[name] = (family.type, labels), family.samples
    assert served == documented
    return samples


def _rows_at(model_dir, step, ids):
    """The rows of `ids` (zeros for keys without one) and w in the job's checkpoint of `step`."""
    from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows

    path = os.path.join(str(model_dir), f"model-{step}")
    rows = table_rows(find_checkpoints(path)[0], "emb")
    by_key = dict(zip(rows["keys"].tolist(), rows["values"]))
    zero = np.zeros(rows["values"].shape[1], np.float32)
    return np.stack([by_key.get(k, zero) for k in ids.tolist()]), tf.train.load_variable(path, "w")


def _job(model, *extra):
    """every_row_job.py on one rank, in the background (mpi_helpers.mpiexec waits for its end)."""
    import subprocess

    from mpi_helpers import JOBS

    launcher = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return subprocess.Popen([launcher, "--oversubscribe", "-np", "1", sys.executable,
                             os.path.join(JOBS, "every_row_job.py"), str(model), "--steps", "40", "--keys", "2000",
                             *map(str, extra)], env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _listed_step(model) -> int:
    latest = tf.train.latest_checkpoint(str(model))
    return int(latest.rsplit("-", 1)[1]) if latest else -1


def test_no_request_sees_part_of_an_update_through_a_job_killed_mid_save_and_a_server_killed(tmp_path):
    """A job adds 1 to every row and to the dense weight at each step and saves a delta of it, while
    the server follows (batching on) and three clients send requests over REST and three over gRPC.
    The job dies inside its save of step 12 (the server goes on serving 11) and is restarted (12 is a
    full save then, applied beside and swapped in); the server is SIGKILLed and restarted while
    deltas keep coming. Every response equals its version's checkpoint exactly: all rows and w of one
    version, never a mix."""
    responses = _serve_a_job_that_changes_every_row(tmp_path, ("--grpc-port", "0", "--enable-batching"))
    assert "batching signatures ['serving_default']" in responses.logs[0], responses.logs[0]
    assert responses.torn == [], (f"{len(responses.torn)} of {len(responses.clients.responses)} responses mix "
                                  f"versions: {responses.torn[:10]}")
    print(f"{len(responses.clients.responses)} responses ({responses.clients.by_api}) over versions "
          f"{responses.versions[0]}..{responses.versions[-1]}, none torn; {responses.clients.refused} refused "
          "connections while the server restarted")


def test_a_server_without_its_write_lock_is_caught_tearing_reads(tmp_path):
    """The negative of the test above: the same job, clients and checks against shardrec-serve with
    its versions' read-write lock taken out (tests/unlocked_serve.py), and the delta's rows and dense
    variables written by separate runs as a server without the lock would: torn responses are found."""
    responses = _serve_a_job_that_changes_every_row(
        tmp_path, ("--grpc-port", "0"), command=(sys.executable, os.path.join(HERE, "unlocked_serve.py")),
        kill_server=False)
    assert responses.torn, f"no torn response among {len(responses.clients.responses)}: the check would miss one"
    print(f"without the lock: {len(responses.torn)} of {len(responses.clients.responses)} responses torn")


class _Served:
    def __init__(self, clients, versions, torn, logs):
        self.clients, self.versions, self.torn, self.logs = clients, versions, torn, logs


def _serve_a_job_that_changes_every_row(tmp_path, server_args, command=None, kill_server=True):
    from live_serving_model import every_row_outputs
    from shardrec.launch.redis_server import free_port
    from shardrec.rank_runtime import export_saved_model

    model = tmp_path / "model"
    first = _job(model, "--pause", "0.8", "--die-in-save", "12")
    wait_for(lambda: _listed_step(model) >= 1, first, 120, "checkpoint 1 listed")
    export_saved_model(str(model / "model-1"), str(tmp_path / "export"), every_row_outputs,
                       {"ids": tf.TensorSpec([None], tf.int64)})
    ids = (np.arange(0, 2000, 5, dtype=np.int64) * 7919 + 11)
    port, grpc_port = free_port(), free_port()
    args = [a if a != "0" else str(grpc_port) for a in server_args]
    extra = {"command": command} if command else {}
    servers = [LiveServer(tmp_path / "export", model, "--port", port, *args, **extra)]
    clients = Clients(lambda: servers[-1].url, ids, grpc_of=lambda: servers[-1].grpc_target)
    second = None
    try:
        first_out = first.communicate(timeout=300)[0]
        assert first.returncode != 0 and os.path.isdir(model / ".sparse-model-12.saving"), first_out
        # A negative: the save killed midway is never served, after two whole looks at the model
        # directory since the job died.
        looked = metric(servers[0], POLLS)
        wait_for(lambda: metric(servers[0], POLLS) >= looked + 2, None, 60, "two looks at the model directory")
        assert servers[0].version() == 11, servers[0].log
        wait_for(lambda: clients.seen(lambda v: v == 11), None, 60, "a response of version 11")
        second = _job(model, "--pause", "0.3")
        servers[0].wait_version(20, timeout=120)
        # Requests across the restarted job's full save of 12 (loaded beside and swapped in).
        wait_for(lambda: clients.seen(lambda v: v >= 12), None, 60, "a response after the full save of 12")
        if kill_server:
            servers[0].stop(signal.SIGKILL)
            servers.append(LiveServer(tmp_path / "export", model, "--port", port, *args, **extra))
            assert servers[-1].version() >= 20
        servers[-1].wait_version(40, timeout=120)
        wait_for(lambda: clients.seen(lambda v: v == 40), None, 60, "a response of version 40")
    finally:
        clients.stop()
        out = second.communicate(timeout=120)[0] if second is not None else ""
        for server in servers:
            server.stop()
    assert second.returncode == 0, out
    if command is None:  # the real server; without its lock a version's session can close under a request
        assert not clients.errors, clients.errors[:5]
    assert clients.by_api["grpc"] > 0 and clients.by_api["rest"] > 0, clients.by_api
    versions = sorted({v for v, _, _ in clients.responses})
    # Requests ran before the kill (11), across the restarted job's full save and after the server's
    # restart (40); how many versions between them a client meets is the machine's speed.
    assert versions[0] <= 11 and 11 in versions and 40 in versions, versions
    # Every step's checkpoint (the job keeps them all): each step added exactly 1 to every row and to w.
    expected = {v: _rows_at(model, v, ids) for v in range(versions[0], 41)}
    for v in range(versions[0] + 1, 41):
        np.testing.assert_allclose(expected[v][0] - expected[v - 1][0], 1.0, atol=1e-5, err_msg=f"rows, step {v}")
        np.testing.assert_allclose(expected[v][1] - expected[v - 1][1], 1.0, atol=1e-5, err_msg=f"w, step {v}")
    torn = [v for v, emb, w in clients.responses
            if not (np.array_equal(emb, expected[v][0]) and np.array_equal(w, np.broadcast_to(expected[v][1], w.shape)))]
    if kill_server:
        assert "loaded whole" in servers[0].log and "a delta applied in place" in servers[-1].log
    return _Served(clients, versions, torn, [s.log for s in servers])


def _flip_byte(path, at_end=16):
    with open(path, "r+b") as f:
        f.seek(-at_end, os.SEEK_END)
        byte = f.read(1)
        f.seek(-at_end, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def _refused(server) -> float:
    return metric(server, "shardrec_serve_refused_checkpoints_total")


def test_damaged_broken_and_incomplete_saves_are_refused_by_name_and_a_restart_serves_the_newest_complete(
        chains, tmp_path):
    """A flipped byte in delta 8: refused (the file named), and delta 12 with it (its chain is broken);
    the version served stays 4 and exact until the full save 16. A listed save with a rank's shard
    missing: refused; a server started afresh serves the newest complete one. Over REST and gRPC
    alike (_assert_serves asks both)."""
    model = tmp_path / "model"
    shutil.copytree(chains[2], model)
    _flip_byte(model / "sparse-model-8" / "rank-0-of-2" / "emb" / "values.npy")
    paths = [str(model / f"model-{s}") for s in STEPS]
    ids = _probe_ids([os.path.join(chains[2], f"model-{s}") for s in STEPS])
    _list(model, paths[:1])
    server = LiveServer(chains["export"], model, "--grpc-port", "0")
    try:
        assert server.wait_version(4) == 4
        for i, refused in ((1, 1), (2, 2)):
            _list(model, paths[:i + 1])
            wait_for(lambda: _refused(server) >= refused, None, 30, f"refusal {refused}")
            assert _refused(server) == refused and server.version() == 4, server.log
        _assert_serves(server, paths[0], ids, tmp_path)
        _list(model, paths[:4])
        assert server.wait_version(16) == 16
        _assert_serves(server, paths[3], ids, tmp_path)
    finally:
        server.stop()
    assert "checkpoint " + paths[1] + " is not served" in server.log and "values.npy" in server.log, server.log
    assert "checkpoint " + paths[2] + " is not served" in server.log and "Still serving version 4" in server.log
    # A save listed with rank 1's shard missing (a copy of 24 as 28), after a complete 24.
    for suffix in (".index", ".data-00000-of-00001", ".meta"):
        shutil.copy(f"{paths[-1]}{suffix}", model / f"model-28{suffix}")
    shutil.copytree(model / "sparse-model-24", model / "sparse-model-28")
    shutil.rmtree(model / "sparse-model-28" / "rank-1-of-2")
    _list(model, paths + [str(model / "model-28")])
    restarted = LiveServer(chains["export"], model, "--grpc-port", "0")
    try:
        assert restarted.version() == 24, restarted.log
        _assert_serves(restarted, paths[-1], ids, tmp_path)
    finally:
        restarted.stop()
    assert "model-28 is not served" in restarted.log and "rank(s) [1] of 2 are missing" in restarted.log, \
        restarted.log


def _tf_serving_api_reads(status, meta, export):
    """The status and metadata responses read into tensorflow-serving-api's own messages, as a TF
    Serving client does: the version state, and the signatures equal to the SavedModel's."""
    from google.protobuf import json_format
    from tensorflow_serving.apis import get_model_metadata_pb2, get_model_status_pb2

    parsed = json_format.ParseDict(status, get_model_status_pb2.GetModelStatusResponse(), ignore_unknown_fields=True)
    assert parsed.model_version_status[0].version == 0
    assert parsed.model_version_status[0].state == get_model_status_pb2.ModelVersionStatus.AVAILABLE
    signatures = json_format.ParseDict(meta["metadata"]["signature_def"], get_model_metadata_pb2.SignatureDefMap())
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        saved = tf.compat.v1.saved_model.load(sess, [tf.saved_model.SERVING], export).signature_def
    assert signatures.signature_def["serving_default"] == saved["serving_default"]


def _predict_request_of_tf_serving_api(ids) -> dict:
    """A PredictRequest as a gRPC client of TF Serving builds it, sent in the REST API's columnar form."""
    from tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name, request.model_spec.signature_name = "model", "serving_default"
    request.inputs["ids"].CopyFrom(tf.make_tensor_proto(ids, tf.int64))
    return {"signature_name": request.model_spec.signature_name,
            "inputs": {name: tf.make_ndarray(proto).tolist() for name, proto in request.inputs.items()}}


def _post(server, body, path="/v1/models/model:predict", raw=False):
    data = body if raw else None
    return requests.post(f"{server.url}{path}", data=data, json=None if raw else body, timeout=30)


def test_tf_serving_s_rest_api_its_formats_and_its_errors(chains, tmp_path):
    """Status, metadata, the row and columnar formats; and bad requests answered with TF Serving's
    status and {"error": ...} naming what was wrong, never a stack trace."""
    server = LiveServer(chains["export"], None, "--max-body-mb", "0.01")
    try:
        status = server.status()
        assert status["model_version_status"] == [{"version": "0", "state": "AVAILABLE",
                                                   "status": {"error_code": "OK", "error_message": ""}}]
        meta = requests.get(f"{server.url}/v1/models/model/metadata", timeout=10).json()
        signature = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
        assert signature["inputs"]["ids"]["dtype"] == "DT_INT64" and set(signature["outputs"]) == {"emb", "score", "w"}
        _tf_serving_api_reads(status, meta, chains["export"])
        ids = _probe_ids([os.path.join(chains[2], "model-4")])[:5]
        columnar, version = server.predict(ids)
        assert version == 0
        request = _predict_request_of_tf_serving_api(ids)
        rebuilt = requests.post(f"{server.url}/v1/models/model:predict", json=request, timeout=30)
        np.testing.assert_array_equal(np.asarray(rebuilt.json()["outputs"]["emb"], np.float32), columnar["emb"])
        want = _oracle(os.path.join(chains[2], "model-4"), tmp_path, ids)
        np.testing.assert_array_equal(columnar["emb"], want["emb"])
        pinned = _post(server, {"inputs": {"ids": ids.tolist()}}, "/v1/models/model/versions/0:predict")
        assert pinned.status_code == 200 and pinned.headers["X-Model-Version"] == "0"
        np.testing.assert_array_equal(np.asarray(pinned.json()["outputs"]["emb"], np.float32), columnar["emb"])
        rows = _post(server, {"instances": ids.tolist(), "signature_name": "serving_default"})
        assert rows.status_code == 400 and "inconsistent batch sizes" in rows.json()["error"]  # w has no batch
        bad = {
            (404, "Servable not found"): ({"instances": [1]}, "/v1/models/other:predict"),
            (404, "Specific(model, 7)"): ({"instances": [1]}, "/v1/models/model/versions/7:predict"),
            (404, "\"nope\" not found"): ({"signature_name": "nope", "instances": [1]}, None),
            (400, "JSON Parse error"): (b"{not json", None),
            (400, "Missing 'inputs' or 'instances'"): ({"signature_name": "serving_default"}, None),
            (400, "expects int64, got a non-integer"): ({"inputs": {"ids": [1.5, 2]}}, None),
            (400, "expects int64 numbers"): ({"inputs": {"ids": ["a"]}}, None),
            (400, "shape [2, 1] does not match the signature's [-1]"): ({"inputs": {"ids": [[1], [2]]}}, None),
            (400, "not a rectangular array"): ({"inputs": {"ids": [[1], [2, 3]]}}, None),
            (400, "alias(es) ['x'] not found"): ({"inputs": {"ids": [1], "x": [2]}}, None),
            (400, "input(s) ['ids'] of signature 'serving_default' missing"): ({"inputs": {}}, None),
            (413, "over the limit of 10485"): ({"inputs": {"ids": list(range(5000))}}, None),
            (400, "classify is not supported"): ({"instances": [1]}, "/v1/models/model:classify"),
            (400, "input 'ids': expects int64, got booleans"): ({"inputs": {"ids": [True, False]}}, None),
            (400, "expects int64, got booleans (true/false)"): ({"instances": [True]}, None),
            (400, "JSON Parse error: the body is nested too deeply"):
                (b'{"inputs": {"ids": ' + b"[" * 5000 + b"]" * 5000 + b"}}", None),
            (400, "input 'ids': not a rectangular array of int64"):
                ({"inputs": {"ids": json.loads("[" * 200 + "1" + "]" * 200)}}, None),
            (404, "Malformed request"): ({}, "/v2/whatever"),
        }
        for (code, message), (body, path) in bad.items():
            r = _post(server, body, path or "/v1/models/model:predict", raw=isinstance(body, bytes))
            assert r.status_code == code and message in r.json()["error"], (code, message, r.status_code, r.text)
            assert "Traceback" not in r.text
        with open(os.path.join(str(tmp_path), "x"), "w"):
            pass
        files = _post(server, {"inputs": {"ids": [1]}}, f"/v1/models/{tmp_path}/x:predict")
        assert files.status_code == 404
    finally:
        server.stop()
    assert "Traceback" not in server.log, server.log


def test_a_columnar_request_whose_inputs_differ_in_batch_size_is_a_400_naming_them(chains, tmp_path):
    """A model of two batched inputs (ids, scale), served: inputs of 3 and 2 rows are refused before
    the graph runs, naming both inputs and the rule, with nothing of TensorFlow's graph in the
    answer; the same inputs of one batch size are answered, score = the one-input model's x scale."""
    from live_serving_model import scaled_outputs
    from shardrec.rank_runtime import export_saved_model

    checkpoint = os.path.join(chains[2], "model-4")
    export = str(tmp_path / "scaled")
    export_saved_model(checkpoint, export, scaled_outputs, {"ids": tf.TensorSpec([None], tf.int64),
                                                            "scale": tf.TensorSpec([None], tf.float32)})
    ids = _probe_ids([checkpoint])[:3]
    server = LiveServer(export, None)
    try:
        r = _post(server, {"inputs": {"ids": ids.tolist(), "scale": [1.0, 2.0]}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "different batch sizes ('ids' 3, 'scale' 2)" in error and "first dimension" in error, error
        for internal in ("node", "Graph execution", "File ", "concat", "mul", "[["):
            assert internal not in error, error
        bare = _post(server, {"instances": ids.tolist()})  # numbers, where two named inputs are wanted
        assert bare.status_code == 400 and "instances must be objects naming" in bare.json()["error"], bare.text
        scale = [1.0, 2.0, -0.5]
        good = _post(server, {"inputs": {"ids": ids.tolist(), "scale": scale}})
        assert good.status_code == 200, good.text
        want = _oracle(checkpoint, tmp_path, ids)["score"] * np.float32(scale)
        np.testing.assert_allclose(np.asarray(good.json()["outputs"]["score"], np.float32), want, rtol=1e-6)
    finally:
        server.stop()


def test_what_the_model_says_of_inputs_it_cannot_run_keeps_the_rule_and_drops_the_graph():
    """TensorFlow's own error of a graph run on inputs that do not fit (a concat of 3 and 2 rows),
    as a request's 400 says it: the rule, without node names, definition sites or code."""
    from shardrec.rank_runtime.serving.live.predictor import model_refusal

    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        a, b = tf.compat.v1.placeholder(tf.float32, [None, 2]), tf.compat.v1.placeholder(tf.float32, [None, 1])
        joined = tf.concat([a, b], 1)
        with pytest.raises(tf.errors.InvalidArgumentError) as raised:
            sess.run(joined, {a: np.zeros((3, 2)), b: np.zeros((2, 1))})
    said = model_refusal(raised.value.message)
    assert "Dimension" in said or "dimension" in said, (said, raised.value.message)
    for internal in ("node", "Detected at", "File ", "[[", "ConcatOp", "test_live_serving"):
        assert internal not in said, (said, raised.value.message)


def test_numbered_version_directories_for_tf_serving_follow_the_job_and_keep_the_newest(chains, tmp_path):
    """shardrec-export --versions: the newest checkpoint as BASE/<step> when it is new, nothing when
    it is not, and only the newest --keep versions left; each one the export of its checkpoint."""
    import subprocess

    model, base = tmp_path / "model", tmp_path / "versions"
    shutil.copytree(chains[2], model)
    paths = [str(model / f"model-{s}") for s in STEPS]
    cli = [os.path.join(os.path.dirname(sys.executable), "shardrec-export"), str(model), "--out", str(base),
           "--versions", "--keep", "2", "--model-fn", os.path.join(HERE, "live_serving_model.py:outputs"),
           "--feature", "ids=int64[-1]"]
    ids = _probe_ids(paths)
    seen = []
    for upto in (2, 2, 3, 4):
        _list(model, paths[:upto])
        done = subprocess.run(cli, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        seen.append(sorted(os.listdir(base)))
    assert seen == [["8"], ["8"], ["12", "8"], ["12", "16"]], seen
    for step in (12, 16):
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            meta = tf.compat.v1.saved_model.load(sess, [tf.saved_model.SERVING], str(base / str(step)))
            signature = meta.signature_def["serving_default"]
            emb = sess.run(signature.outputs["emb"].name, {signature.inputs["ids"].name: ids})
        np.testing.assert_array_equal(emb, _oracle(paths[STEPS.index(step)], tmp_path, ids)["emb"])
    bad = subprocess.run(cli[:-4] + ["--keep", "0"] + cli[-4:], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--keep (>= 1)" in bad.stderr, bad.stderr


def test_bad_arguments_are_named_before_anything_is_served(chains, tmp_path):
    """No SavedModel, a --follow that is not a directory, a SavedModel that shardrec-export did not
    write asked to follow a job, a gRPC port out of range or taken, a batch of no instances, a thread
    setting TensorFlow has no meaning for: exit status 2, the cause named."""
    import subprocess

    from live_server import SERVE

    plain = str(tmp_path / "plain")
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        x = tf.compat.v1.placeholder(tf.float32, [None], name="x")
        builder = tf.compat.v1.saved_model.Builder(plain)
        builder.add_meta_graph_and_variables(sess, [tf.saved_model.SERVING], signature_def_map={
            "serving_default": tf.compat.v1.saved_model.predict_signature_def({"x": x}, {"y": x * 2})})
        builder.save()
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    cases = [([str(tmp_path / "none")], "not a SavedModel (no saved_model.pb)"),
             ([chains["export"], "--follow", str(tmp_path / "none")], "--follow"),
             ([plain, "--follow", chains[2]], "has no shardrec tables' layout"),
             ([chains["export"], "--grpc-port", "70000"], "--grpc-port 70000: must be 0..65535"),
             ([chains["export"], "--enable-batching", "--max-batch-size", "0"], "--max-batch-size"),
             ([chains["export"], "--tensorflow-inter-op-parallelism", "-2"], "-1 (the request's thread), 0"),
             ([chains["export"], "--grpc-port", str(taken.getsockname()[1])], "cannot listen")]
    try:
        for args, message in cases:
            done = subprocess.run([SERVE, *args, "--port", "0"], capture_output=True, text=True, timeout=120)
            assert done.returncode == 2 and message in done.stderr, (args, done.returncode, done.stderr[-2000:])
    finally:
        taken.close()
