"""TF Serving's REST API, the request and response side (https://www.tensorflow.org/tfx/serving/api_rest):
a predict body's row format ("instances") or columnar format ("inputs") into one array per
signature input, checked against the signature's dtypes and shapes; outputs back into
"predictions" or "outputs"; errors as TF Serving gives them, {"error": message} with its status."""
import base64
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from ....native import json_arrays
from .feeds import InputError, check_aliases, check_batch, check_shape
from .model_graph import Signature


class RestError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class PredictRequest:
    signature: str
    feeds: dict  # alias -> np.ndarray
    row_format: bool


def _json(body: bytes):
    """The body's JSON value, its rectangular arrays of numbers read natively into numpy arrays."""
    try:
        return json_arrays.parse(body)
    except ValueError as e:
        raise RestError(400, f"JSON Parse error: {e}") from None


def signature_name(doc: dict) -> str:
    name = doc.get("signature_name", "serving_default")
    if not isinstance(name, str):
        raise RestError(400, "'signature_name' must be a string")
    return name


def parse_predict(body: bytes, signatures: dict) -> PredictRequest:
    doc = _json(body)
    if not isinstance(doc, dict):
        raise RestError(400, "JSON Value: the request body must be an object with 'instances' or 'inputs'")
    name = signature_name(doc)
    signature = signatures.get(name)
    if signature is None:
        raise RestError(404, f"Serving signature name: \"{name}\" not found in signature def; the model has "
                             f"{sorted(signatures)}")
    if ("instances" in doc) == ("inputs" in doc):
        raise RestError(400, "Missing 'inputs' or 'instances' key" if "instances" not in doc else
                        "Not both 'inputs' and 'instances' keys; a request has one of them")
    if "instances" in doc:
        columns = _columns_of_rows(doc["instances"], signature)
    else:
        given = doc["inputs"]
        if isinstance(given, dict) and not _is_b64(given):
            columns = given
        elif len(signature.inputs) == 1:
            columns = {next(iter(signature.inputs)): given}
        else:
            raise RestError(400, f"'inputs' must be an object of the signature's inputs {sorted(signature.inputs)}")
    return PredictRequest(name, _feeds(columns, signature, "instances" in doc), "instances" in doc)


def _columns_of_rows(instances, signature: Signature) -> dict:
    aliases = list(signature.inputs)
    if isinstance(instances, np.ndarray) and instances.ndim:  # a list of numbers, read as one array
        if len(aliases) != 1:
            raise RestError(400, f"instances must be objects naming the signature's inputs {aliases}")
        return {aliases[0]: instances}
    if not isinstance(instances, list) or not instances:
        raise RestError(400, "'instances' must be a non-empty list")
    if all(isinstance(i, dict) for i in instances) and not (len(aliases) == 1 and _is_b64(instances[0])):
        names = set(instances[0])
        if any(set(i) != names for i in instances):
            raise RestError(400, "Failed to process element: every instance must have the same named inputs")
        return {name: [i[name] for i in instances] for name in names}
    if len(aliases) != 1:
        raise RestError(400, f"instances must be objects naming the signature's inputs {aliases}")
    return {aliases[0]: instances}


def _is_b64(value) -> bool:
    return isinstance(value, dict) and set(value) == {"b64"}


def _array(alias, value, spec) -> np.ndarray:
    if spec.dtype == tf.string:
        def decode(v):
            if _is_b64(v):
                return base64.b64decode(v["b64"])
            if isinstance(v, list):
                return [decode(x) for x in v]
            if isinstance(v, np.ndarray):
                raise RestError(400, f"input {alias!r}: expects strings, got numbers")
            if not isinstance(v, str):
                raise RestError(400, f"input {alias!r}: expects strings, got {type(v).__name__}")
            return v.encode()
        return np.array(decode(value), dtype=object)
    try:
        array = np.asarray(value)  # an array the parser made is not copied
    except (ValueError, RecursionError) as e:
        raise RestError(400, f"input {alias!r}: not a rectangular array of {spec.dtype.name} ({e})") from None
    if array.dtype == object or array.dtype.kind not in "biuf":
        raise RestError(400, f"input {alias!r}: expects {spec.dtype.name} numbers in a rectangular list")
    if (array.dtype.kind == "b") != (spec.dtype == tf.bool) and array.size:
        # JSON's true and false are not numbers, nor numbers booleans, as TF Serving reads them.
        got = "booleans (true/false)" if array.dtype.kind == "b" else "numbers"
        raise RestError(400, f"input {alias!r}: expects {spec.dtype.name}, got {got}")
    if spec.dtype.is_integer and array.dtype.kind == "f":
        raise RestError(400, f"input {alias!r}: expects {spec.dtype.name}, got a non-integer number")
    if spec.dtype.is_integer and array.dtype != spec.dtype.as_numpy_dtype:  # int64 from JSON fits int64
        info = np.iinfo(spec.dtype.as_numpy_dtype)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise RestError(400, f"input {alias!r}: a value is out of the range of {spec.dtype.name}")
    return array.astype(spec.dtype.as_numpy_dtype)


def _feeds(columns: dict, signature: Signature, row_format: bool) -> dict:
    try:
        check_aliases(columns, signature)
        feeds = {}
        for alias, spec in signature.inputs.items():
            feeds[alias] = _array(alias, columns[alias], spec)
            check_shape(alias, feeds[alias], spec)
        if row_format and len({a.shape[0] if a.ndim else None for a in feeds.values()}) > 1:
            raise InputError("instances: the named inputs have different batch sizes")
        check_batch(feeds, signature)
    except InputError as e:
        raise RestError(400, str(e)) from None
    return feeds


def _plain(array):
    if array.dtype == object:
        return [_plain(np.asarray(x)) for x in array] if array.ndim else \
            {"b64": base64.b64encode(array.item()).decode()}
    return array.tolist()


def encode_predict(outputs: dict, row_format: bool) -> dict:
    if not row_format:
        plain = {k: _plain(v) for k, v in outputs.items()}
        return {"outputs": next(iter(plain.values())) if len(plain) == 1 else plain}
    if len(outputs) == 1:
        return {"predictions": _plain(next(iter(outputs.values())))}
    batches = {k: v.shape[0] if v.ndim else None for k, v in outputs.items()}
    if len(set(batches.values())) > 1 or None in batches.values():
        raise RestError(400, f"the outputs have inconsistent batch sizes {batches}: ask for the columnar format "
                             "('inputs' instead of 'instances')")
    rows = {k: _plain(v) for k, v in outputs.items()}
    batch = next(iter(batches.values()))
    return {"predictions": [{k: v[i] for k, v in rows.items()} for i in range(batch)]}
