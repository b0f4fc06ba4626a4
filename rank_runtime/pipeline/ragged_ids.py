"""Variable-length (multi-hot) ids: a feature whose examples hold different numbers of ids, as a
`tf.RaggedTensor` [batch, (ids)] (what `Dataset.ragged_batch` gives) or a `tf.SparseTensor`
[batch, max ids] (what `tf.io.parse_example` gives a VarLenFeature). The key pipeline and the
lookup see both as ragged: the flat ids in example order, and row splits."""
from typing import Any
import tensorflow as tf

VARIABLE_LENGTH = (tf.RaggedTensor, tf.SparseTensor)


def is_variable_length(x: Any) -> bool:
    return isinstance(x, VARIABLE_LENGTH)


def is_variable_length_spec(spec: Any) -> bool:
    return isinstance(spec, (tf.RaggedTensorSpec, tf.SparseTensorSpec))


def check_spec(owner: str, feature: str, spec: Any) -> None:
    """A dataset element's ids: dense, or [batch, (ids)] ragged / [batch, n] sparse, int32 or int64."""
    if spec.dtype not in (tf.int32, tf.int64):
        raise TypeError(f"{owner}: feature {feature!r} has ids of dtype {spec.dtype.name}; ids must be int32 or int64")
    if is_variable_length_spec(spec) and spec.shape.rank not in (None, 2):
        raise TypeError(f"{owner}: feature {feature!r} has variable-length ids of shape {spec.shape}; allowed: "
                        "[batch, (ids per example)], a RaggedTensor of ragged_rank 1 or a 2-D SparseTensor")
    if isinstance(spec, tf.RaggedTensorSpec) and spec.ragged_rank != 1:
        raise TypeError(f"{owner}: feature {feature!r} is a RaggedTensor of ragged_rank {spec.ragged_rank}; "
                        "allowed: ragged_rank 1 ([batch, (ids per example)])")
    if not is_variable_length_spec(spec) and not isinstance(spec, tf.TensorSpec):
        raise TypeError(f"{owner}: feature {feature!r} is a {type(spec).__name__}; allowed: a dense id tensor, a "
                        "RaggedTensor or a SparseTensor")


def as_ragged(x: Any, what: str = "ids") -> tf.RaggedTensor:
    """[batch, (ids)] from a RaggedTensor or a 2-D SparseTensor (in row-major order, as
    tf.sparse.reorder puts it: the order the key pipeline and the lookup both use)."""
    if isinstance(x, tf.SparseTensor):
        if x.shape.rank is not None and x.shape.rank != 2:
            raise ValueError(f"{what}: a SparseTensor of shape {x.shape}; allowed: 2-D [batch, ids per example]")
        return tf.RaggedTensor.from_sparse(tf.sparse.reorder(x))
    if isinstance(x, tf.RaggedTensor):
        if x.ragged_rank != 1 or (x.shape.rank is not None and x.shape.rank != 2):
            raise ValueError(f"{what}: a RaggedTensor of shape {x.shape} (ragged_rank {x.ragged_rank}); allowed: "
                             "[batch, (ids per example)], ragged_rank 1")
        return x
    raise TypeError(f"{what}: expected a RaggedTensor or a SparseTensor, got {type(x).__name__}")


def key_inputs(x: Any) -> Any:
    """What the key pipeline hands the native exchange for one pooled feature: flat ids, int64 row splits."""
    ragged = as_ragged(x)
    return [ragged.flat_values, tf.cast(ragged.row_splits, tf.int64)]


def empty_like(spec):
    """An element of `spec` with no ids (the key pipeline's end marker): as many empty examples as
    a static batch size says, else none."""
    examples = (spec.shape[0] if spec.shape.rank else None) or 0
    if isinstance(spec, tf.RaggedTensorSpec):
        inner = [tf.zeros([1], spec.row_splits_dtype)] * (spec.ragged_rank - 1)
        return tf.RaggedTensor.from_nested_row_splits(
            tf.zeros([0], spec.dtype), [tf.zeros([examples + 1], spec.row_splits_dtype)] + inner, validate=False)
    rank = spec.shape.rank or 2
    shape = [examples] + [d or 0 for d in (spec.shape.as_list()[1:] if spec.shape.rank else [0] * (rank - 1))]
    return tf.SparseTensor(tf.zeros([0, rank], tf.int64), tf.zeros([0], spec.dtype), tf.constant(shape, tf.int64))


def component_spec(tensor: Any) -> Any:
    """A dataset iterator's output as the dataset holds it: a ragged or sparse component travels as a
    variant, which its consumer in the graph decodes (and names the type of)."""
    if tensor.dtype == tf.variant:
        for consumer in tensor.consumers():
            if consumer.type == "RaggedTensorFromVariant":
                return tf.RaggedTensorSpec(None, consumer.get_attr("Tvalues"), consumer.get_attr("output_ragged_rank"),
                                           consumer.get_attr("Tsplits"))
            if consumer.type == "DeserializeSparse":
                return tf.SparseTensorSpec(None, consumer.get_attr("dtype"))
    return tf.TensorSpec(tensor.shape, tensor.dtype)


def encoded(spec, value):
    """`value` as the iterator's output tensor carries it (a variant for ragged and sparse values)."""
    if not is_variable_length_spec(spec):
        return value
    return spec._to_tensor_list(value)[0]  # pylint: disable=protected-access
