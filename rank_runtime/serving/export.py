"""Writing a SavedModel for serving, in Estimator mode (`Estimator.export_saved_model`) and from a
model function in tf.Session mode (`export_saved_model`).

Both rebuild the inference graph while `exporting(checkpoint)` is active: every `create_table`
returns a `StockTable` sized from the checkpoint's manifests, every `sparse_lookup` looks the
receiver's ids up in it. `ExportSaver` restores the dense variables from the checkpoint and fills
the stock tables from every rank's shard (any world size, any storage tier: the checkpoint holds
every row), then saves all of them into the SavedModel's variables."""
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import tensorflow as tf

from ..embedding import export_view
from ..pipeline import combiners, ragged_ids
from ..pipeline.feature_spec import FeatureSpec
from ..process.logs import get_logger
from ..formats.sparse_checkpoint import CheckpointError, move_into_place
from .saved_rows import SavedTables, saved_tables
from .stock_table import StockTable
from ..validation import check_dtype

log = get_logger("shardrec.serving")


@dataclass
class ExportedTable:
    name: str
    rows: int
    dim: int
    bytes: int


@dataclass
class ExportSummary:
    """What an export wrote: the directory, the checkpoint it came from, its tables and signature."""
    export_dir: str
    checkpoint: str
    tables: list = field(default_factory=list)  # [ExportedTable]
    inputs: dict = field(default_factory=dict)  # name -> "dtype[shape]"
    outputs: dict = field(default_factory=dict)
    seconds: float = 0.0

    def lines(self) -> list:
        out = [f"SavedModel {self.export_dir} from {self.checkpoint} ({self.seconds:.1f} s)"]
        out += [f"  table {t.name}: {t.rows} rows of dim {t.dim}, {t.bytes / 2**20:.1f} MiB" for t in self.tables]
        out.append("  signature serving_default: inputs " + ", ".join(f"{k} {v}" for k, v in self.inputs.items())
                   + "; outputs " + ", ".join(f"{k} {v}" for k, v in self.outputs.items()))
        return out


def _describe(tensor) -> str:
    return f"{tensor.dtype.name}{tensor.shape.as_list() if tensor.shape.rank is not None else '[?]'}"


class ServingExport:
    """The export in progress: the checkpoint's tables, the stock tables built from them so far,
    and which receiver features the lookups read."""

    def __init__(self, save_path, row_dtype=tf.float32):
        self.row_dtype = row_dtype
        self.saved: SavedTables = saved_tables(save_path)
        self.tables = {}
        self.features_read = set()

    def table(self, name: str, key_dtype: tf.DType, dim: int) -> StockTable:
        saved = self.saved.tables.get(name)
        if saved is None:
            raise CheckpointError(f"{self.saved.save_path}: has no table {name!r} to export; it has "
                                  f"{sorted(self.saved.tables)}")
        if saved.dim != dim:
            raise CheckpointError(f"{self.saved.save_path}: table {name!r} was saved with dim {saved.dim}, the "
                                  f"model creates it with dim {dim}")
        if name in self.tables:
            raise ValueError(f"create_table: a table named {name!r} already exists in this export graph")
        self.tables[name] = StockTable(name, key_dtype, dim, saved.rows, self.row_dtype)
        return self.tables[name]

    def lookup(self, table, ids, batch, serving_default_value, name, combiner=None, weights=None) -> tf.Tensor:
        if not isinstance(table, StockTable) or self.tables.get(table.table_name) is not table:
            raise ValueError(f"sparse_lookup: {getattr(table, 'table_name', table)!r} is not a table of this export "
                             "graph; create tables inside the model function that the export calls")
        if isinstance(ids, (list, tuple)) and len(ids) == 1:
            ids = ids[0]
        if isinstance(ids, FeatureSpec):
            # The raw ids the spec reads from a batch (its index_key, its name by default).
            key = ids.index_key
            if not isinstance(batch, dict) or key not in batch:
                have = sorted(batch) if isinstance(batch, dict) else []
                raise KeyError(f"sparse_lookup: feature {key!r} of table {table.table_name!r} is not among the "
                               f"serving receiver's features {have}")
            self.features_read.add(key)
            ids = batch[key]
        combiner = combiners.check_combiner(combiner, ragged_ids.is_variable_length(ids))
        if combiner is None:
            return table.lookup(tf.convert_to_tensor(ids), serving_default_value, name)
        # Variable-length ids: the stock lookup of every id, then the same pooling as training's.
        ragged = ragged_ids.as_ragged(ids)
        rows = table.lookup(ragged.flat_values, serving_default_value, name)
        return combiners.combine_rows(rows, ragged, combiners.checked_weights(weights, ragged), combiner)

    def variables(self) -> list:
        return [v for t in self.tables.values() for v in t.variables]

    def fill(self, sess: tf.compat.v1.Session) -> list:
        """Every stock table's rows from the checkpoint; [ExportedTable]."""
        done = []
        for name, table in sorted(self.tables.items()):
            started = time.monotonic()
            said = [started]

            def progress(rows, total, name=name, started=started, said=said):
                if time.monotonic() - said[0] > 10:
                    said[0] = time.monotonic()
                    log.info("table %r: %d of %d rows read (%.0f s)", name, rows, total, said[0] - started)

            keys, values = self.saved.rows_of(name, progress)
            table.fill(sess, keys, values)
            done.append(ExportedTable(name, len(keys), table.dim, values.nbytes + keys.nbytes))
            log.info("table %r: %d rows of dim %d exported", name, len(keys), table.dim)
        return done


def export_in(graph: tf.Graph, save_path: Any, row_dtype: tf.DType = tf.float32) -> ServingExport:
    """An export whose tables create_table and sparse_lookup make in `graph` (embedding/export_view.py);
    save_path: a checkpoint prefix, or every rank's prefix of one saved under a path per rank."""
    export = ServingExport(save_path, row_dtype)
    export_view.build_in(graph, export)
    return export


class ExportSaver(tf.compat.v1.train.Saver):
    """Saves every variable of the export graph (dense and stock tables); restoring from a training
    checkpoint reads the dense variables from it and the tables' rows from its shards."""

    def __init__(self, export: ServingExport):
        super().__init__(sharded=True)
        self._export = export
        tables = {id(v) for v in export.variables()}
        dense = [v for v in tf.compat.v1.global_variables() if id(v) not in tables]
        self._dense = tf.compat.v1.train.Saver(var_list=dense) if dense else None
        self.exported = []

    def restore(self, sess: tf.compat.v1.Session, save_path: Any) -> None:
        if self._dense is not None:
            self._dense.restore(sess, save_path)
        self.exported = self._export.fill(sess)


def unread_features(export: ServingExport, features: dict, outputs: Iterable[tf.Tensor]) -> list:
    """Receiver features that nothing in the graph reads and no output returns (a name the model
    does not have)."""
    returned = {id(t) for t in outputs}
    return sorted(name for name, t in features.items() if name not in export.features_read
                  and isinstance(t, tf.Tensor) and not t.consumers() and id(t) not in returned)


def resolve_checkpoint(path: str) -> Any:
    """A dense checkpoint prefix from a prefix or a model directory (its newest checkpoint); a list
    (one prefix per rank, for per-rank paths) is kept as it is."""
    if isinstance(path, (list, tuple)):
        return [str(p) for p in path]
    if os.path.isdir(path):
        latest = tf.train.latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"{path}: a directory without a checkpoint (no 'checkpoint' file naming one)")
        return latest
    return path


def _check_target(export_dir: str, overwrite: bool) -> None:
    if os.path.exists(export_dir) and not overwrite:
        raise FileExistsError(f"export_saved_model: {export_dir} exists; choose a new directory, or pass "
                              "overwrite=True (--overwrite) to replace it")


def export_saved_model(checkpoint: str, export_dir: str, model_fn, inputs: dict, overwrite: bool = False,
                       row_dtype=tf.float32) -> ExportSummary:
    """Writes a SavedModel of stock TensorFlow ops to `export_dir` (tf.Session mode).

    checkpoint: a dense checkpoint prefix (<dir>/model.ckpt-N), a model directory (its newest), or
    for a checkpoint saved under a path per rank (seed 001's `model-{rank}`) the list of every
    rank's prefix.
    model_fn(features) -> {name: tensor}: the inference graph, built as in training (create_table,
    sparse_lookup with the features' tensors or FeatureSpecs and batch=features); it is called in
    a new graph with a placeholder for every entry of `inputs` ({name: tf.TensorSpec}).
    The signature "serving_default" maps `inputs` to model_fn's outputs. Nothing is written when
    the checkpoint is damaged or the graph cannot be built.
    row_dtype: how the export holds the tables' rows: tf.float32 (the default, whatever the tables
    were trained in), or tf.float16 / tf.bfloat16 (half the memory; the rows of a table trained in
    that dtype exactly, others each to the nearest). Lookups return float32 either way."""
    started = time.monotonic()
    row_dtype = check_dtype("export_saved_model", "row_dtype", row_dtype, (tf.float32, tf.float16, tf.bfloat16))
    _check_target(export_dir, overwrite)
    if not isinstance(inputs, dict) or not inputs or not all(isinstance(s, tf.TensorSpec) for s in inputs.values()):
        raise TypeError("export_saved_model: inputs must be a non-empty dict of feature name -> tf.TensorSpec")
    save_path = resolve_checkpoint(checkpoint)
    with tf.Graph().as_default() as graph:
        export = export_in(graph, save_path, row_dtype)
        features = {name: tf.compat.v1.placeholder(s.dtype, s.shape, name=name) for name, s in inputs.items()}
        outputs = model_fn(features)
        if not isinstance(outputs, dict) or not outputs or not all(isinstance(t, tf.Tensor) for t in outputs.values()):
            raise TypeError(f"export_saved_model: model_fn must return a dict of name -> tensor, got {outputs!r}")
        unread = unread_features(export, features, outputs.values())
        if unread:
            raise ValueError(f"export_saved_model: input feature(s) {unread} are not used by the model (nothing in "
                             f"its graph reads them); the inputs are {sorted(features)}")
        saver = ExportSaver(export)
        signature = tf.compat.v1.saved_model.predict_signature_def(features, outputs)
        with tf.compat.v1.Session() as sess:
            saver.restore(sess, export.saved.save_path)
            write_saved_model(sess, export_dir, {"serving_default": signature}, saver, overwrite)
    summary = ExportSummary(export_dir, export.saved.save_path, saver.exported, {k: _describe(t) for k, t in features.items()},
                            {k: _describe(t) for k, t in outputs.items()}, time.monotonic() - started)
    for line in summary.lines():
        log.info("%s", line)
    return summary


def write_saved_model(sess: tf.compat.v1.Session, export_dir: str, signatures: dict, saver: Any,
                      overwrite: bool) -> None:
    """The SavedModel, written next to `export_dir` and moved into place whole."""
    parent = os.path.dirname(os.path.abspath(export_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(export_dir)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        builder = tf.compat.v1.saved_model.Builder(tmp)
        builder.add_meta_graph_and_variables(sess, [tf.saved_model.SERVING], signature_def_map=signatures,
                                             main_op=tf.compat.v1.tables_initializer(), saver=saver,
                                             strip_default_attrs=True)
        builder.save()
        _check_target(export_dir, overwrite)  # again: it may have appeared while this export ran
        move_into_place(tmp, export_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
