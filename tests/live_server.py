"""shardrec-serve as a test runs it: the real command in a process of its own, on a free localhost
port, spoken to over HTTP with `requests` (tests/test_live_serving.py, the demo's test); its
figures read from /metrics; clients that send requests until stopped."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import requests

SERVE = os.path.join(os.path.dirname(sys.executable), "shardrec-serve")


class LiveServer:
    def __init__(self, saved_model, follow=None, *extra, log_path=None):
        args = [SERVE, str(saved_model), "--port", "0", "--poll-s", "0.1", *map(str, extra)]
        if follow is not None:
            args += ["--follow", str(follow)]
        self.log_path = log_path
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        self.lines = []
        self.url = None
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

    def stop(self, sig=None):
        if self.proc.poll() is None:
            if sig is None:
                self.proc.terminate()
            else:
                self.proc.send_signal(sig)
            self.proc.wait(timeout=30)
        self._reader.join(timeout=5)


def metric(server, name) -> float:
    """The value of `name` on the server's /metrics (its first sample)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{server.url}/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


class Clients:
    """Threads that send predict requests until stopped, each response kept with its version;
    connection errors (the server restarting) counted, not kept."""

    def __init__(self, url_of, ids, threads=3):
        self.url_of, self.ids, self.responses, self.refused = url_of, ids, [], 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]
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

    def seen(self, wanted) -> bool:
        """Whether a response of a version for which wanted(version) holds came back."""
        return any(wanted(v) for v, _, _ in list(self.responses))

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)
