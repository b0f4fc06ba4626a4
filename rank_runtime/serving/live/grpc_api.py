"""TF Serving's gRPC API (the protos of tensorflow-serving-api, served by grpcio):
`tensorflow.serving.PredictionService` (Predict, GetModelMetadata), `tensorflow.serving.ModelService`
(GetModelStatus) and `grpc.health.v1.Health`. TensorProtos in and out, no JSON on the path; the same
versions, checks and metrics as the REST side (predictor.py). Requests arrive as bytes and are
parsed here, so that a malformed one is INVALID_ARGUMENT naming the message, not grpcio's INTERNAL;
a message over the limit is refused by grpcio itself with RESOURCE_EXHAUSTED."""
import math
import time
from concurrent import futures
from typing import Any, Callable, Dict, Optional

import grpc
import numpy as np
import tensorflow as tf
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tensorflow_serving.apis import get_model_metadata_pb2, get_model_status_pb2, model_pb2, predict_pb2

from ...process.logs import get_logger
from .feeds import InputError, check_aliases, check_batch, check_shape
from .model_graph import TensorSpecOf
from .predictor import PredictError, Predictor
from .versions import VersionInfo

log = get_logger("shardrec.serve")
PREDICTION_SERVICE = "tensorflow.serving.PredictionService"
MODEL_SERVICE = "tensorflow.serving.ModelService"


def _version_of(spec: model_pb2.ModelSpec) -> Optional[int]:
    return spec.version.value if spec.HasField("version") else None


def _array(alias: str, proto: Any, spec: TensorSpecOf, limit: int) -> np.ndarray:
    given = tf.dtypes.as_dtype(proto.dtype) if proto.dtype else None
    if given != spec.dtype:
        raise InputError(f"input {alias!r}: expects {spec.dtype.name}, got "
                         f"{given.name if given is not None else 'no dtype'} (TensorProto.dtype)")
    dims = [d.size for d in proto.tensor_shape.dim]
    if any(d < 0 for d in dims):
        raise InputError(f"input {alias!r}: TensorProto.tensor_shape {dims} has a negative dimension")
    # A TensorProto may give fewer values than its shape holds (TensorFlow repeats the last one):
    # a few bytes could declare terabytes, so the decoded size is bounded as a message is.
    decoded = math.prod(dims) * max(1, spec.dtype.size)
    if decoded > limit:
        raise PredictError("RESOURCE_EXHAUSTED", f"input {alias!r}: shape {dims} of {spec.dtype.name} is {decoded} "
                           f"bytes decoded, over the limit of {limit} (shardrec-serve --max-body-mb)")
    try:
        array = tf.make_ndarray(proto)
    except (ValueError, TypeError) as e:
        raise InputError(f"input {alias!r}: the TensorProto does not hold a {spec.dtype.name} tensor of its "
                         f"shape: {e}") from None
    check_shape(alias, array, spec)
    return array


class _Calls:
    """The three services' methods over one Predictor."""

    def __init__(self, predictor: Predictor, max_message_bytes: int):
        self.predictor, self.limit = predictor, max_message_bytes
        self.metrics = predictor.served.metrics

    def predict(self, request: predict_pb2.PredictRequest) -> predict_pb2.PredictResponse:
        p = self.predictor
        spec = request.model_spec
        p.version(spec.name, _version_of(spec), spec.version_label)
        signature = p.signature(spec.signature_name)
        try:
            check_aliases(request.inputs.keys(), signature)
            feeds = {alias: _array(alias, request.inputs[alias], s, self.limit)
                     for alias, s in signature.inputs.items()}
            check_batch(feeds, signature)
            wanted = list(request.output_filter) or list(signature.outputs)
            unknown = sorted(set(wanted) - set(signature.outputs))
            if unknown:
                raise InputError(f"output_filter names {unknown}, not outputs of signature {signature.name!r}: "
                                 f"its outputs are {sorted(signature.outputs)}")
        except InputError as e:
            raise PredictError("INVALID_ARGUMENT", str(e)) from None
        outputs, info = p.predict(signature, feeds, spec.name, _version_of(spec))
        response = predict_pb2.PredictResponse()
        _spec(response.model_spec, spec.name, info, signature.name)
        for alias in wanted:
            response.outputs[alias].CopyFrom(tf.make_tensor_proto(outputs[alias]))
        return response

    def metadata(self, request: get_model_metadata_pb2.GetModelMetadataRequest
                 ) -> get_model_metadata_pb2.GetModelMetadataResponse:
        spec = request.model_spec
        info = self.predictor.version(spec.name, _version_of(spec), spec.version_label)
        fields = list(request.metadata_field)
        if fields != ["signature_def"]:
            raise PredictError("INVALID_ARGUMENT", f"metadata_field {fields}: the one field served is "
                                                   "['signature_def']")
        defs = get_model_metadata_pb2.SignatureDefMap()
        for name, signature in self.predictor.served.graph.signatures.items():
            defs.signature_def[name].CopyFrom(signature.proto)
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        _spec(response.model_spec, spec.name, info, "")
        response.metadata["signature_def"].Pack(defs)
        return response

    def status(self, request: get_model_status_pb2.GetModelStatusRequest
               ) -> get_model_status_pb2.GetModelStatusResponse:
        spec = request.model_spec
        info = self.predictor.version(spec.name, _version_of(spec), spec.version_label)
        response = get_model_status_pb2.GetModelStatusResponse()
        status = response.model_version_status.add()
        status.version, status.state = info.number, get_model_status_pb2.ModelVersionStatus.AVAILABLE
        status.status.error_code = 0
        return response


def _spec(out: model_pb2.ModelSpec, name: str, info: VersionInfo, signature: str) -> None:
    out.name, out.signature_name = name, signature
    out.version.value = info.number


def _handler(call: Callable[[Any], Message], request_type: Any, endpoint: str, metrics: Any) -> Any:
    def handle(data: bytes, context: grpc.ServicerContext) -> bytes:
        started, code = time.monotonic(), "OK"
        try:
            try:
                request = request_type.FromString(data)
            except DecodeError as e:
                raise PredictError("INVALID_ARGUMENT", f"the request is not a {request_type.DESCRIPTOR.full_name}: "
                                                       f"{e}") from None
            return call(request).SerializeToString()
        except PredictError as e:
            code = e.code
            context.abort(getattr(grpc.StatusCode, e.code), e.message)
        except Exception as e:  # a request never gets a stack trace; the log has it
            code = "INTERNAL"
            log.exception("gRPC %s", endpoint)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
        finally:
            metrics.requests.labels("grpc", endpoint, code).inc()
            if endpoint == "predict":
                metrics.latency.labels("grpc").observe(time.monotonic() - started)
        raise AssertionError("unreachable: context.abort raises")

    return grpc.unary_unary_rpc_method_handler(handle, request_deserializer=None, response_serializer=None)


class GrpcServer:
    """The gRPC services of `predictor` on HOST:PORT (0: any free port, `.port` says which), with
    `threads` requests in flight and requests and responses up to `max_message_bytes`."""

    def __init__(self, predictor: Predictor, host: str, port: int, threads: int, max_message_bytes: int):
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardrec-grpc"),
                                  options=[("grpc.max_receive_message_length", max_message_bytes),
                                           ("grpc.max_send_message_length", max_message_bytes),
                                           ("grpc.so_reuseport", 0)])
        calls, metrics = _Calls(predictor, max_message_bytes), predictor.served.metrics
        handlers: Dict[str, Dict[str, Any]] = {
            PREDICTION_SERVICE: {
                "Predict": _handler(calls.predict, predict_pb2.PredictRequest, "predict", metrics),
                "GetModelMetadata": _handler(calls.metadata, get_model_metadata_pb2.GetModelMetadataRequest,
                                             "metadata", metrics)},
            MODEL_SERVICE: {"GetModelStatus": _handler(calls.status, get_model_status_pb2.GetModelStatusRequest,
                                                       "status", metrics)}}
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, methods)
                                              for service, methods in handlers.items()])
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._set_health(predictor.served.info is not None)
        predictor.served.listeners.append(lambda info: self._set_health(True))
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:  # grpcio raises where older releases returned 0
            self.port = 0
        if self.port == 0:
            raise OSError(f"gRPC cannot listen on {host}:{port} (in use, or not an address of this host)")

    def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", PREDICTION_SERVICE, MODEL_SERVICE):
            self.health.set(service, status)

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace=1.0).wait(5)
