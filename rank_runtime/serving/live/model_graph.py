"""A shardrec SavedModel's graph, loaded once, with the ops that bring a session of it to a
checkpoint: per table, a find in its index, a scatter of rows, an insert and a removal of keys, and
assigning or growing its values; an assignment per dense variable. Every session of the server runs
this one graph (a session holds its own variables and tables)."""
from dataclasses import dataclass
from typing import Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.saved_model import loader_impl

from ..stock_table import LAYOUT_COLLECTION, TableLayout


@dataclass(frozen=True)
class TensorSpecOf:
    """A signature's input or output: its alias, the graph tensor, dtype and shape (None: any)."""
    alias: str
    tensor: str
    dtype: tf.DType
    shape: tuple


@dataclass(frozen=True)
class Signature:
    name: str
    inputs: dict  # alias -> TensorSpecOf
    outputs: dict
    proto: object  # the SignatureDef, for the metadata endpoint


class _TableOps:
    def __init__(self, layout: TableLayout, graph):
        self.layout = layout
        index = graph.get_tensor_by_name(layout.index)
        values = graph.get_tensor_by_name(layout.values + ":0")
        # float32, or 16 bits (export_saved_model's row_dtype): rows are fed as float32 and cast.
        dtype = graph.get_operation_by_name(layout.values).get_attr("dtype")
        ph = tf.compat.v1.placeholder
        self.find_keys = ph(tf.int64, [None])
        self.find = tf.raw_ops.LookupTableFindV2(table_handle=index, keys=self.find_keys,
                                                 default_value=tf.constant(layout.zero_row, tf.int64))
        self.rows, self.rows_values = ph(tf.int64, [None]), ph(tf.float32, [None, layout.dim])
        self.insert_keys, self.insert_rows, self.remove_keys = ph(tf.int64, [None]), ph(tf.int64, [None]), \
            ph(tf.int64, [None])
        self.update = tf.group(
            tf.raw_ops.ResourceScatterUpdate(resource=values, indices=self.rows,
                                             updates=tf.cast(self.rows_values, dtype)),
            tf.raw_ops.LookupTableInsertV2(table_handle=index, keys=self.insert_keys, values=self.insert_rows),
            tf.raw_ops.LookupTableRemoveV2(table_handle=index, keys=self.remove_keys))
        self.all_values = ph(tf.float32, [None, layout.dim])
        self.assign = tf.raw_ops.AssignVariableOp(resource=values, value=tf.cast(self.all_values, dtype))
        self.grow_to = ph(tf.int32, [])
        now = tf.raw_ops.ReadVariableOp(resource=values, dtype=dtype)
        extra = tf.zeros(tf.stack([self.grow_to - tf.shape(now)[0], layout.dim]), dtype)
        self.grow = tf.raw_ops.AssignVariableOp(resource=values, value=tf.concat([now, extra], 0))
        self.size = tf.raw_ops.LookupTableSizeV2(table_handle=index)


class ModelGraph:
    """The graph of the SavedModel at `export_dir`, finalized once the update ops are added; every
    session of it takes `session_config` (None: TensorFlow's defaults)."""

    def __init__(self, export_dir: str, tags=(tf.saved_model.SERVING,),
                 session_config: Optional[tf.compat.v1.ConfigProto] = None):
        self.graph = tf.Graph()
        self.session_config = session_config
        loader = loader_impl.SavedModelLoader(export_dir)
        meta = loader.get_meta_graph_def_from_tags(list(tags))
        self._loader, self._tags = loader, list(tags)
        with self.graph.as_default():
            self._saver, _ = loader.load_graph(self.graph, self._tags)
            self.layouts = [TableLayout.from_json(t) for t in self.graph.get_collection(LAYOUT_COLLECTION)]
            self.tables = {t.name: _TableOps(t, self.graph) for t in self.layouts}
            table_vars = {t.values for t in self.layouts} | {t.keys for t in self.layouts}
            self.dense = {}
            for v in self.graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
                if v.op.name not in table_vars:
                    value = tf.compat.v1.placeholder(v.dtype.base_dtype, v.shape)
                    self.dense[v.op.name] = (value, tf.compat.v1.assign(v, value))
        self.signatures = {name: _signature(name, sig) for name, sig in meta.signature_def.items()}
        self.graph.finalize()

    @property
    def follows_checkpoints(self) -> bool:
        """Whether this SavedModel was written by shardrec-export (its tables' layouts are known)."""
        return bool(self.layouts)

    def new_session(self) -> tf.compat.v1.Session:
        return tf.compat.v1.Session(graph=self.graph, config=self.session_config)

    def load_own_variables(self, sess: tf.compat.v1.Session) -> None:
        """The SavedModel's own variables and main op: the export's state (no checkpoint followed)."""
        self._loader.restore_variables(sess, self._saver)
        self._loader.run_init_ops(sess, self._tags)

    def find_rows(self, sess: tf.compat.v1.Session, table: str, keys: np.ndarray) -> np.ndarray:
        ops = self.tables[table]
        return sess.run(ops.find, {ops.find_keys: keys})


def _spec(alias, info) -> TensorSpecOf:
    shape = None if info.tensor_shape.unknown_rank else tuple(
        None if d.size < 0 else d.size for d in info.tensor_shape.dim)
    return TensorSpecOf(alias, info.name, tf.as_dtype(info.dtype), shape)


def _signature(name, sig) -> Signature:
    return Signature(name, {a: _spec(a, i) for a, i in sorted(sig.inputs.items())},
                     {a: _spec(a, i) for a, i in sorted(sig.outputs.items())}, sig)
