"""shardrec's TensorFlow op library (native/src/tf_*.cc, built by the set-up next to the pybind11
core as `shardrec/native/tf_ops*.so`): the sparse optimizers' fused apply kernels and a lookup's row
gathers with their gradient.

Loaded on first use; a missing library, or one built against another TensorFlow, stops with an
error that says how to rebuild it instead of a bare dlopen message.
"""
import glob
import os

import tensorflow as tf

REBUILD = "run the set-up again (`bash scripts/bootstrap.sh`, or any `make` target), which rebuilds it for the " \
          "installed TensorFlow"
KERNELS = ("shardrec_sparse_apply_sgd", "shardrec_sparse_apply_adagrad", "shardrec_sparse_apply_lazy_adam",
           "shardrec_sparse_apply_ftrl", "shardrec_row_gather", "shardrec_row_gather_grad", "shardrec_variable_row_gather")
_loaded = {}


def library_path():
    from .. import native

    found = sorted(p for d in native.__path__ for p in glob.glob(os.path.join(d, "tf_ops*.so")))
    if not found:
        raise RuntimeError(f"shardrec's TensorFlow op library (tf_ops*.so) is not in {list(native.__path__)}: {REBUILD}")
    return found[-1]


def load(path=None):
    """The op library's Python module (its ops as functions); `path` for tests."""
    path = path or library_path()
    if path not in _loaded:
        try:
            module = tf.load_op_library(path)
        except (tf.errors.NotFoundError, OSError) as e:
            raise RuntimeError(f"shardrec's TensorFlow op library {path} cannot be loaded into TensorFlow "
                               f"{tf.__version__} ({str(e).strip()}): {REBUILD}") from None
        missing = [k for k in KERNELS if not hasattr(module, k)]
        if missing:
            raise RuntimeError(f"{path} is not shardrec's op library for this version (no {', '.join(missing)}): "
                               f"{REBUILD}")
        _loaded[path] = module
    return _loaded[path]


def variable_row_gather(variable, index):
    """variable[index] for a table's 2-D float32 resource variable, in parallel over the rows and
    reading ahead; its gradient is registered by the lookup (IndexedSlices over `index`)."""
    rows = load().shardrec_variable_row_gather(variable.handle, index, dim=int(variable.shape[1]))
    return rows


def row_gather(rows, index):
    """rows[index] for a 2-D float32 `rows`, in parallel over the output rows; its gradient is the
    dense sum per row of `rows` (what TensorFlow's gather + unsorted segment sum give)."""
    return load().shardrec_row_gather(rows, index)


@tf.RegisterGradient("ShardrecRowGather")
def _row_gather_grad(op, grad):
    rows, index = op.inputs
    return load().shardrec_row_gather_grad(grad, index, tf.shape(rows, out_type=tf.int32)[0]), None
