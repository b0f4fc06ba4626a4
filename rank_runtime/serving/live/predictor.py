"""What a predict request does once its API has read it, the same for REST and gRPC: the version
asked for resolved against the one served, the inputs run on one version (batched with other
requests when batching is on), and every refusal as a `PredictError` whose code is the gRPC status
TF Serving answers with (REST maps it to an HTTP status)."""
import re
from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from .batching import Batcher, BatchOptions, QueueFull
from .feeds import batched_signature
from .follower import NoVersion, Served
from .model_graph import Signature
from .versions import VersionInfo


class PredictError(Exception):
    """A refused request: `code` is a gRPC status code's name (NOT_FOUND, INVALID_ARGUMENT,
    FAILED_PRECONDITION, UNAVAILABLE), the message says what was wrong."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Predictor:
    def __init__(self, served: Served, model_name: str, batching: Optional[BatchOptions] = None):
        self.served, self.model_name = served, model_name
        self.batcher = Batcher(self._run_now, batching, served.metrics.batch.observe) if batching else None
        self.batched = {name: batching is not None and batched_signature(s) for name, s in served.graph.signatures.items()}

    def version(self, name: str, version: Optional[int], label: str = "") -> VersionInfo:
        """The version served, when it is the one asked for (`version` None: the latest)."""
        if name != self.model_name:
            raise PredictError("NOT_FOUND", f"Servable not found for request: Latest({name}); this server serves "
                                            f"{self.model_name!r}")
        if label:
            raise PredictError("NOT_FOUND", f"version label {label!r} of {name} is not assigned: this server "
                                            "serves one version, asked for by number or as the latest")
        info = self.served.info
        if info is None:
            raise PredictError("NOT_FOUND", f"Servable not found for request: Latest({name}) (no version is loaded "
                                            "yet)")
        if version is not None and version != info.number:
            raise PredictError("NOT_FOUND", f"Servable not found for request: Specific({name}, {version}); version "
                                            f"{info.number} is served")
        return info

    def signature(self, name: str) -> Signature:
        signature = self.served.graph.signatures.get(name or "serving_default")
        if signature is None:
            raise PredictError("FAILED_PRECONDITION", f"Serving signature key \"{name}\" not found; the model has "
                                                      f"{sorted(self.served.graph.signatures)}")
        return signature

    def predict(self, signature: Signature, feeds: Dict[str, np.ndarray], name: str,
                version: Optional[int]) -> Tuple[Dict[str, np.ndarray], VersionInfo]:
        """(outputs by alias, the version that computed them), for inputs already checked."""
        try:
            if self.batcher is not None and self.batched[signature.name]:
                outputs, info = self.batcher.run(signature, feeds)
            else:
                outputs, info = self._run_now(signature, feeds)
        except NoVersion:
            raise PredictError("UNAVAILABLE", "no version is loaded; try again") from None
        except QueueFull as e:
            raise PredictError("UNAVAILABLE", str(e)) from None
        except tf.errors.InvalidArgumentError as e:
            raise PredictError("INVALID_ARGUMENT", model_refusal(e.message)) from None
        if version is not None and version != info.number:  # replaced while the request waited
            raise PredictError("NOT_FOUND", f"Servable not found for request: Specific({name}, {version}); version "
                                            f"{info.number} is served")
        return outputs, info

    def _run_now(self, signature: Signature, feeds: Dict[str, np.ndarray]) -> Tuple[Dict[str, np.ndarray], VersionInfo]:
        fetches = {a: spec.tensor for a, spec in signature.outputs.items()}
        return self.served.run(fetches, {signature.inputs[a].tensor: v for a, v in feeds.items()})

    def close(self) -> None:
        if self.batcher is not None:
            self.batcher.close()


_GRAPH_LINES = ("Graph execution error", "Detected at node", "File ", "Node:", "[[")
_OP_PREFIX = re.compile(r"^\w+Op ?: ")


def model_refusal(message: str) -> str:
    """What the model said of inputs it could not run, without TensorFlow's graph or code: the first
    line of its message that is neither a node, a definition site nor an op's name."""
    lines = (line.strip() for line in message.splitlines())
    rule = next((line for line in lines if line and not line.startswith(_GRAPH_LINES)
                 and not line.endswith("(most recent call last):")), "")
    return f"the model refused the request's inputs: {_OP_PREFIX.sub('', rule) or 'an input does not fit the model'}"
