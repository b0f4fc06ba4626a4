"""shardrec-serve as a test runs it: the real command in a process of its own, on a free localhost
port, spoken to over HTTP with `requests` and over gRPC with tensorflow-serving-api's own stubs
(tests/test_live_serving.py, tests/test_grpc_serving.py, the demo's test); its figures read from
/metrics; clients that send requests until stopped."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import requests

SERVE = os.path.join(os.path.dirname(sys.executable), "shardrec-serve")


class LiveServer:
    def __init__(self, saved_model, follow=None, *extra, log_path=None, command=(SERVE,)):
        args = [*command, str(saved_model), "--port", "0", "--poll-s", "0.1", *map(str, extra)]
        if follow is not None:
            args += ["--follow", str(follow)]
        self.log_path = log_path
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        self.lines = []
        self.url = None
        self.grpc_target = None  # HOST:PORT when started with --grpc-port
        self._serving = threading.Event()
        # The output is read by a thread of its own from the start, so that the wait for the
        # "serving ... on URL" line below is bounded even when the server prints nothing.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._serving.wait(timeout=120):
            self.stop()
            raise AssertionError("shardrec-serve did not say where it serves within 120 s:\n" + "".join(self.lines))
        assert self.url, "shardrec-serve ended before it served:\n" + "".join(self.lines)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.grpc_target is None and line.startswith("grpc "):
                self.grpc_target = line.split(" on ", 1)[1].strip()
            if self.url is None and line.startswith("serving "):
                self.url = line.split(" on ", 1)[1].strip()
                self._serving.set()
        self._serving.set()  # the server ended before serving: the wait ends, with self.url None

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def status(self) -> dict:
        return requests.get(f"{self.url}/v1/models/model", timeout=10).json()

    def version(self):
        status = self.status()
        if "model_version_status" not in status:
            return None
        return int(status["model_version_status"][0]["version"])

    def wait_version(self, version, timeout=60):
        """Waits until the server serves `version` or a newer one (it may pass over a version whose
        successor was listed first); returns the version served."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            served = self.version()
            if served is not None and served >= version:
                return served
            time.sleep(0.05)
        raise AssertionError(f"version {version} not served in {timeout} s (serving {self.version()}):\n{self.log}")

    def predict(self, ids, session=None):
        """(outputs as float arrays, the version that answered) for `ids`, columnar format."""
        r = (session or requests).post(f"{self.url}/v1/models/model:predict",
                                       json={"inputs": {"ids": np.asarray(ids).tolist()}}, timeout=30)
        assert r.status_code == 200, r.text
        return {k: np.asarray(v, np.float32) for k, v in r.json()["outputs"].items()}, \
            int(r.headers["X-Model-Version"])

    def grpc_predict(self, ids, channel=None, **spec):
        """(outputs as arrays, the version that answered) for `ids`, by PredictionServiceStub.Predict."""
        import grpc
        from tensorflow_serving.apis import prediction_service_pb2_grpc

        own = channel is None
        channel = channel or grpc.insecure_channel(self.grpc_target)
        try:
            response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(
                grpc_request(ids, **spec), timeout=30)
        finally:
            if own:
                channel.close()
        return {k: tf_make_ndarray(v) for k, v in response.outputs.items()}, response.model_spec.version.value

    def stop(self, sig=None):
        if self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        self._reader.join(timeout=5)


def grpc_request(ids, name="model", signature="serving_default", version=None, inputs=None):
    """A PredictRequest as a TF Serving client builds it (tf.make_tensor_proto of each input)."""
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2

    request = predict_pb2.PredictRequest()
    request.model_spec.name, request.model_spec.signature_name = name, signature
    if version is not None:
        request.model_spec.version.value = version
    for alias, value in (inputs if inputs is not None else {"ids": np.asarray(ids, np.int64)}).items():
        request.inputs[alias].CopyFrom(tf.make_tensor_proto(value))
    return request


def tf_make_ndarray(proto):
    import tensorflow as tf

    return tf.make_ndarray(proto)


def metric(server, name) -> float:
    """The value of `name` on the server's /metrics (its first sample)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{server.url}/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


class Clients:
    """Threads that send predict requests until stopped, each response kept with its version;
    connection errors (the server restarting) counted, not kept."""

    def __init__(self, url_of, ids, threads=3, grpc_of=None):
        """`grpc_of`: the server's gRPC HOST:PORT (a callable, read at each request): as many more
        threads that ask over gRPC."""
        self.url_of, self.grpc_of, self.ids, self.responses, self.refused = url_of, grpc_of, ids, [], 0
        self.by_api, self.errors = {"rest": 0, "grpc": 0}, []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]
        if grpc_of is not None:
            self._threads += [threading.Thread(target=self._grpc_loop, daemon=True) for _ in range(threads)]
        for t in self._threads:
            t.start()

    def _loop(self):
        session = requests.Session()
        body = {"inputs": {"ids": self.ids.tolist()}}
        while not self._stop.is_set():
            try:
                r = session.post(f"{self.url_of()}/v1/models/model:predict", json=body, timeout=30)
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
                # refused, or cut mid-response by the SIGKILL
                self.refused += 1
                time.sleep(0.05)
                continue
            if r.status_code == 200:
                out = r.json()["outputs"]
                self.responses.append((int(r.headers["X-Model-Version"]), np.asarray(out["emb"], np.float32),
                                       np.asarray(out["w"], np.float32)))
                self.by_api["rest"] += 1

    def _grpc_loop(self):
        import grpc
        from tensorflow_serving.apis import prediction_service_pb2_grpc

        request, target, channel = grpc_request(self.ids), None, None
        while not self._stop.is_set():
            if target != self.grpc_of():  # a restarted server: the same port, a new connection
                target = self.grpc_of()
                channel = grpc.insecure_channel(target)
            try:
                response = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:  # anything but a server away is kept, for the test
                    self.errors.append(f"{e.code()}: {e.details()}")
                self.refused += 1
                time.sleep(0.05)
                continue
            out = response.outputs
            self.responses.append((response.model_spec.version.value, tf_make_ndarray(out["emb"]),
                                   tf_make_ndarray(out["w"])))
            self.by_api["grpc"] += 1

    def seen(self, wanted) -> bool:
        """Whether a response of a version for which wanted(version) holds came back."""
        return any(wanted(v) for v, _, _ in list(self.responses))

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
