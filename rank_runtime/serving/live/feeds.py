"""A predict request's inputs checked against its signature, whichever API they came by (REST's
JSON, gRPC's TensorProtos): the aliases it names, each array's shape, the batch it shares. An
`InputError` names the input and what the signature allows; REST answers it 400, gRPC
INVALID_ARGUMENT."""
from typing import Dict, Iterable

import numpy as np

from .model_graph import Signature, TensorSpecOf


class InputError(ValueError):
    """The request's inputs do not fit the signature (the message names the input)."""


def check_aliases(given: Iterable[str], signature: Signature) -> None:
    given = set(given)
    unknown = sorted(given - set(signature.inputs))
    if unknown:
        raise InputError(f"input tensor alias(es) {unknown} not found in signature {signature.name!r}; its "
                         f"inputs are {sorted(signature.inputs)}")
    missing = sorted(set(signature.inputs) - given)
    if missing:
        raise InputError(f"input(s) {missing} of signature {signature.name!r} missing from the request")


def check_shape(alias: str, array: np.ndarray, spec: TensorSpecOf) -> None:
    if spec.shape is None:
        return
    fits = len(array.shape) == len(spec.shape) and all(
        want is None or want == have for want, have in zip(spec.shape, array.shape))
    if not fits:
        want = [-1 if d is None else d for d in spec.shape]
        raise InputError(f"input {alias!r}: shape {list(array.shape)} does not match the signature's "
                         f"{want} (-1: any size)")


def check_batch(feeds: Dict[str, np.ndarray], signature: Signature) -> None:
    """Inputs that all have the batch as their first dimension have the same batch."""
    batched = {alias: feeds[alias].shape[0] for alias, spec in signature.inputs.items()
               if spec.shape is not None and len(spec.shape) and spec.shape[0] is None}
    if len(batched) == len(feeds) and len(set(batched.values())) > 1:
        sizes = ", ".join(f"{alias!r} {n}" for alias, n in sorted(batched.items()))
        raise InputError(f"inputs: the inputs have different batch sizes ({sizes}); every input of signature "
                         f"{signature.name!r} has the batch as its first dimension, the same in all of them")


def batched_signature(signature: Signature) -> bool:
    """Whether requests on `signature` can be run together: every input and output has the batch as
    its first dimension (rank known, that dimension of any size), so that the inputs concatenate and
    the outputs split back per request."""
    specs = list(signature.inputs.values()) + list(signature.outputs.values())
    return bool(signature.inputs) and all(s.shape is not None and len(s.shape) and s.shape[0] is None
                                          for s in specs)
