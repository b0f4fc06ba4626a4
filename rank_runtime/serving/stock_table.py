"""What a table becomes in an export graph: stock TensorFlow ops only.

Keys and rows are variables (written to the SavedModel's variables files, never constants in its
graph, so a table of any size keeps the graph small). The index from key to row number is a
`tf.lookup.experimental.MutableHashTable` filled from the keys variable by the SavedModel's main op
(a table initializer, which TF Serving and `tf.saved_model.load` run after restoring variables); it
is mutable, not a static table, so that shardrec-serve can apply a delta's rows to a loaded model in
place. A key with no row reads row `rows`, zeros, as an evaluation lookup in training does;
`serving_default_value` replaces it. Each table's layout (names of its variables and index) goes
into the graph's collection LAYOUT_COLLECTION, which the SavedModel keeps, for shardrec-serve."""
import json
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import numpy as np
import tensorflow as tf

from ..validation import check_type

LAYOUT_COLLECTION = "shardrec_serving_tables"


@dataclass(frozen=True)
class TableLayout:
    """Where one table lives in an export graph. zero_row: the row that keys without one read (the
    export's row count); rows of keys added later by shardrec-serve go after it."""
    name: str
    dim: int
    zero_row: int
    keys: str  # the keys variable's op name (what the main op fills the index from)
    values: str  # the values variable's op name
    index: str  # the index's resource handle tensor

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: Union[str, bytes]) -> "TableLayout":
        fields = json.loads(text.decode() if isinstance(text, bytes) else text)
        return cls(**{k: fields[k] for k in cls.__dataclass_fields__})


class StockTable:
    """A table of `rows` keys in an export graph; filled by `fill(sess, keys, values)`. Rows are held
    in `row_dtype` (float32, or float16 / bfloat16 for half the memory: a 16-bit table's rows as they
    were trained) and looked up as float32."""

    def __init__(self, name: str, key_dtype: tf.DType, dim: int, rows: int, row_dtype: tf.DType = tf.float32):
        self.table_name = name
        self.key_dtype = key_dtype
        self.dim = dim
        self.rows = rows
        with tf.name_scope(f"{name}/"):
            self._keys_in = tf.compat.v1.placeholder(tf.int64, [rows], name="keys_in")
            self._values_in = tf.compat.v1.placeholder(row_dtype, [rows + 1, dim], name="values_in")
            self.keys = tf.compat.v1.Variable(self._keys_in, trainable=False, name="keys", use_resource=True)
            self.values = tf.compat.v1.Variable(self._values_in, trainable=False, name="values", use_resource=True)
            self.index = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, default_value=rows,
                                                                 name="index", checkpoint=False)
            fill_index = self.index.insert(self.keys.read_value(), tf.range(rows, dtype=tf.int64))
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS, fill_index)
        layout = TableLayout(name, dim, rows, self.keys.op.name, self.values.op.name, self.index.resource_handle.name)
        tf.compat.v1.add_to_collection(LAYOUT_COLLECTION, layout.to_json())

    @property
    def variables(self) -> list:
        return [self.keys, self.values]

    def fill(self, sess: tf.compat.v1.Session, keys: np.ndarray, values: np.ndarray) -> None:
        values = np.asarray(values, self._values_in.dtype.as_numpy_dtype)  # each to the nearest
        sess.run([self.keys.initializer, self.values.initializer],
                 feed_dict={self._keys_in: keys, self._values_in: values})

    def lookup(self, ids: tf.Tensor, serving_default_value: Any = None, name: Optional[str] = None) -> tf.Tensor:
        """The rows of `ids` (any shape, int32 or int64): ids.shape + [dim]."""
        check_type("sparse_lookup", "ids", ids, tf.Tensor, "an id tensor (the serving receiver's feature)")
        if not (ids.dtype.is_integer):
            raise TypeError(f"sparse_lookup: ids of table {self.table_name!r} must be int32 or int64, got {ids.dtype.name}")
        with tf.name_scope(name or f"{self.table_name}_lookup"):
            row = self.index.lookup(tf.cast(ids, tf.int64))
            emb = tf.cast(tf.gather(self.values, row), tf.float32)
            if serving_default_value is not None:
                default = tf.broadcast_to(tf.cast(serving_default_value, tf.float32), [self.dim])
                emb = tf.where(tf.equal(row, self.rows)[..., None], tf.broadcast_to(default, tf.shape(emb)), emb)
            return emb
