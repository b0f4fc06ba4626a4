"""What a table becomes in an export graph: stock TensorFlow ops only.

Keys and rows are variables (written to the SavedModel's variables files, never constants in its
graph, so a table of any size keeps the graph small); a `tf.lookup.StaticHashTable` from key to row
number is built from the keys variable when the model loads (the SavedModel's main op, which TF
Serving and `tf.saved_model.load` run after restoring variables). A key with no row reads the last
row, zeros, as an evaluation lookup in training does; `serving_default_value` replaces it."""
import tensorflow as tf

from ..validation import check_type


class StockTable:
    """A table of `rows` keys in an export graph; filled by `fill(sess, keys, values)`."""

    def __init__(self, name: str, key_dtype: tf.DType, dim: int, rows: int):
        self.table_name = name
        self.key_dtype = key_dtype
        self.dim = dim
        self.rows = rows
        with tf.name_scope(f"{name}/"):
            self._keys_in = tf.compat.v1.placeholder(tf.int64, [rows], name="keys_in")
            self._values_in = tf.compat.v1.placeholder(tf.float32, [rows + 1, dim], name="values_in")
            self.keys = tf.compat.v1.Variable(self._keys_in, trainable=False, name="keys", use_resource=True)
            self.values = tf.compat.v1.Variable(self._values_in, trainable=False, name="values", use_resource=True)
            init = tf.lookup.KeyValueTensorInitializer(self.keys.read_value(), tf.range(rows, dtype=tf.int64))
            self.index = tf.lookup.StaticHashTable(init, default_value=rows, name="index")

    @property
    def variables(self) -> list:
        return [self.keys, self.values]

    def fill(self, sess, keys, values) -> None:
        sess.run([self.keys.initializer, self.values.initializer],
                 feed_dict={self._keys_in: keys, self._values_in: values})

    def lookup(self, ids, serving_default_value=None, name=None) -> tf.Tensor:
        """The rows of `ids` (any shape, int32 or int64): ids.shape + [dim]."""
        check_type("sparse_lookup", "ids", ids, tf.Tensor, "an id tensor (the serving receiver's feature)")
        if not (ids.dtype.is_integer):
            raise TypeError(f"sparse_lookup: ids of table {self.table_name!r} must be int32 or int64, got {ids.dtype.name}")
        with tf.name_scope(name or f"{self.table_name}_lookup"):
            row = self.index.lookup(tf.cast(ids, tf.int64))
            emb = tf.gather(self.values, row)
            if serving_default_value is not None:
                default = tf.broadcast_to(tf.cast(serving_default_value, tf.float32), [self.dim])
                emb = tf.where(tf.equal(row, self.rows)[..., None], tf.broadcast_to(default, tf.shape(emb)), emb)
            return emb
