"""get_dense_and_sparse_variable: the two kinds of variables a training script optimises."""
import tensorflow as tf

from .table import SPARSE_TABLES_COLLECTION


def get_dense_and_sparse_variable() -> tuple:
    """(dense trainable variables, sparse table variables) of the default graph."""
    sparse = tf.compat.v1.get_collection(SPARSE_TABLES_COLLECTION)
    sparse_ids = {id(v) for v in sparse}
    dense = [v for v in tf.compat.v1.trainable_variables() if id(v) not in sparse_ids]
    return dense, sparse
