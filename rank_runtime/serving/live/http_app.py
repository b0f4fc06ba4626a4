"""shardrec-serve's HTTP side: TF Serving's REST endpoints as a WSGI application, served by
waitress (several requests in flight, one thread each; TensorFlow runs them in parallel).

    GET  /v1/models/NAME[/versions/N]             status: the version served
    GET  /v1/models/NAME[/versions/N]/metadata    signatures
    POST /v1/models/NAME[/versions/N]:predict     row ("instances") or columnar ("inputs") format
    GET  /metrics                                 Prometheus's text format

Every predict response carries the version that answered it in the header X-Model-Version; a
request for a version other than the one served gets TF Serving's 404."""
import json
import re
import time
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format

from ...process.logs import get_logger
from .predictor import PredictError, Predictor
from .rest_api import RestError, encode_predict, parse_predict

log = get_logger("shardrec.serve")
_ROUTE = re.compile(r"/v1/models/(?P<name>[^/:]+)(?:/versions/(?P<version>-?\d+))?(?P<rest>/metadata|:predict|"
                    r":classify|:regress)?/?")
VERSION_HEADER = "X-Model-Version"


@dataclass(frozen=True)
class AppSettings:
    model_name: str
    max_body_bytes: int


class RestApp:
    def __init__(self, predictor: Predictor, settings: AppSettings):
        self.predictor, self.settings = predictor, settings
        self.served = predictor.served
        self.metrics = self.served.metrics

    def __call__(self, environ, start_response):
        started = time.monotonic()
        endpoint, headers = "other", []
        try:
            endpoint, status, body, headers = self._route(environ)
        except RestError as e:
            status, body = e.status, {"error": e.message}
        except Exception as e:  # a request never gets a stack trace; the log has it
            log.exception("request %s %s", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"))
            status, body = 500, {"error": f"internal error: {type(e).__name__}: {e}"}
        self.metrics.requests.labels("rest", endpoint, str(status)).inc()
        if endpoint == "predict":
            self.metrics.latency.labels("rest").observe(time.monotonic() - started)
        if isinstance(body, bytes):
            data, kind = body, "text/plain; version=0.0.4"
        else:
            data, kind = json.dumps(body).encode(), "application/json"
        start_response(f"{status} {_REASONS.get(status, 'Error')}",
                       [("Content-Type", kind), ("Content-Length", str(len(data)))] + headers)
        return [data]

    def _route(self, environ) -> tuple:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
        if path == "/metrics" and method == "GET":
            return "metrics", 200, self.metrics.text(), []
        m = _ROUTE.fullmatch(path)
        if m is None:
            raise RestError(404, f"Malformed request: {method} {path}")
        name, version, rest = m.group("name"), m.group("version"), m.group("rest")
        try:
            info = self.predictor.version(name, None if version is None else int(version))
        except PredictError as e:
            raise RestError(_HTTP[e.code], e.message) from None
        if rest in (":classify", ":regress"):
            raise RestError(400, f"{rest[1:]} is not supported by this model's signatures; use :predict")
        if rest == ":predict":
            if method != "POST":
                raise RestError(405, "predict takes POST")
            return ("predict",) + self._predict(_body(environ, self.settings.max_body_bytes), name, version)
        if method != "GET":
            raise RestError(405, f"{path} takes GET")
        if rest == "/metadata":
            return "metadata", 200, self._metadata(name, info.number), []
        return "status", 200, _status(info), []

    def _predict(self, body: bytes, name: str, version) -> tuple:
        request = parse_predict(body, self.served.graph.signatures)
        try:
            outputs, info = self.predictor.predict(self.served.graph.signatures[request.signature], request.feeds,
                                                   name, None if version is None else int(version))
        except PredictError as e:
            raise RestError(_HTTP[e.code], e.message) from None
        return 200, encode_predict(outputs, request.row_format), [(VERSION_HEADER, str(info.number))]

    def _metadata(self, name, number) -> dict:
        defs = {n: json_format.MessageToDict(s.proto, preserving_proto_field_name=True)
                for n, s in self.served.graph.signatures.items()}
        return {"model_spec": {"name": name, "signature_name": "", "version": str(number)},
                "metadata": {"signature_def": {"signature_def": defs}}}


def _status(info) -> dict:
    return {"model_version_status": [{"version": str(info.number), "state": "AVAILABLE",
                                      "status": {"error_code": "OK", "error_message": ""}}],
            "shardrec": {"checkpoint": info.checkpoint.rsplit("/", 1)[-1], "committed_at": info.committed_at,
                         "served_at": info.served_at}}


def _body(environ, limit: int) -> bytes:
    length = environ.get("CONTENT_LENGTH")
    if length and int(length) > limit:
        raise RestError(413, f"request body of {int(length)} bytes is over the limit of {limit} "
                             "(shardrec-serve --max-body-mb)")
    data = environ["wsgi.input"].read(int(length) if length else limit + 1)
    if len(data) > limit:
        raise RestError(413, f"request body over the limit of {limit} bytes (shardrec-serve --max-body-mb)")
    return data


# TF Serving's REST statuses for the codes its gRPC side answers with.
_HTTP = {"NOT_FOUND": 404, "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "UNAVAILABLE": 503}
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 413: "Payload Too Large",
            500: "Internal Server Error", 503: "Service Unavailable"}


def make_server(app: RestApp, host: str, port: int, threads: int) -> Any:
    """A waitress server of `app` (not started: its .run() serves until .close()); port 0 picks one
    (the server's .effective_port)."""
    import waitress

    return waitress.create_server(app, host=host, port=port, threads=threads, ident="shardrec-serve",
                                  max_request_body_size=app.settings.max_body_bytes + (1 << 20))
