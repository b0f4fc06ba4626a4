"""Multi-path warm start (the user guide's "Custom WarmStart"): tf.estimator.WarmStartSettings whose fields may be lists, one
entry per checkpoint, applied in order; for each dense variable and each table the last entry
that selects it decides where it comes from.

    settings = tf.estimator.WarmStartSettings(
        ckpt_to_initialize_from=["./ws1", "./ws2", "./ws3"],
        vars_to_warm_start=[".*", ["user_table", "item_table"], "mlp_layer_w"],
        var_name_to_prev_var_name=[{}, {}, {}])
    Estimator(..., warm_start_from=settings)                  # Estimator mode
    warm_start(sess, settings)                                # Session mode, after the initializers

Selections: a string is a regular expression; for dense (trainable) variables it matches the
start of the name, as TensorFlow's warm start does; for tables it must match the whole table
name, so a table's name selects that table. A list holds names (or variables). A checkpoint path
may be a directory (its latest checkpoint is used). var_name_to_prev_var_name renames dense
variables only: tables keep their names, and asking to rename one is an error.
"""
import re
from typing import Any

import tensorflow as tf

from ..process import config
from ..process.logs import get_logger
from .table_restore import restore_tables
from ..embedding.table import SPARSE_SLOTS_COLLECTION, SPARSE_TABLES_COLLECTION
from ..validation import check_type

log = get_logger("shardrec.warm_start")
_OWNER = "warm start"


def _as_list(value, n):
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def entries(settings: Any) -> list:
    """[(checkpoint path, selection, prev-name map)] from WarmStartSettings, lists or single."""
    if isinstance(settings, str):
        settings = tf.estimator.WarmStartSettings(ckpt_to_initialize_from=settings)
    check_type(_OWNER, "warm_start_from", settings, (tf.estimator.WarmStartSettings,),
               "tf.estimator.WarmStartSettings or a checkpoint path")
    paths = settings.ckpt_to_initialize_from
    paths = list(paths) if isinstance(paths, (list, tuple)) else [paths]
    n = len(paths)
    # A list of names is one selection in the single form, one selection per path in the list form.
    selections = settings.vars_to_warm_start
    if not isinstance(settings.ckpt_to_initialize_from, (list, tuple)):
        selections = [selections]
    elif not isinstance(selections, (list, tuple)):
        selections = [selections] * n
    renames = _as_list(settings.var_name_to_prev_var_name or {}, n)
    if settings.var_name_to_vocab_info:
        raise ValueError(f"{_OWNER}: var_name_to_vocab_info is not supported: tables keep their keys, so no vocabulary "
                         "remapping is needed")
    if not (len(selections) == len(renames) == n):
        raise ValueError(f"{_OWNER}: ckpt_to_initialize_from has {n} path(s) but vars_to_warm_start has "
                         f"{len(selections)} and var_name_to_prev_var_name {len(renames)}; give one per path")
    for i, path in enumerate(paths):
        check_type(_OWNER, f"ckpt_to_initialize_from[{i}]", path, str, "a checkpoint path or directory")
    return list(zip(paths, selections, [r or {} for r in renames]))


def _selects(selection, name, is_table):
    if selection is None:
        return not is_table  # TensorFlow's default: every trainable variable
    if isinstance(selection, str):
        return bool(re.fullmatch(selection, name) if is_table else re.match(selection, name))
    names = [getattr(s, "op", None).name if hasattr(s, "op") else s for s in selection]
    return name in names


def _resolve(path):
    if tf.io.gfile.isdir(path):
        latest = tf.train.latest_checkpoint(path)
        if latest is None:
            raise ValueError(f"{_OWNER}: no committed checkpoint in directory {path!r}")
        return latest
    return path


def plan(settings: Any, graph: tf.Graph | None = None) -> list:
    """({dense variable: (path, name in checkpoint)}, {table: path}) for the tables and trainable
    variables of `graph`; the last entry selecting each wins."""
    graph = graph or tf.compat.v1.get_default_graph()
    tables = config.get_config().graph_state(graph).tables
    with graph.as_default():
        sparse = {id(v) for c in (SPARSE_TABLES_COLLECTION, SPARSE_SLOTS_COLLECTION)
                  for v in tf.compat.v1.get_collection(c)}
        dense = [v for v in tf.compat.v1.trainable_variables() if id(v) not in sparse]
    dense_from, tables_from = {}, {}
    for path, selection, renames in entries(settings):
        renamed_tables = sorted(set(renames) & set(tables)) + sorted(set(renames.values()) & set(tables))
        if renamed_tables:
            raise ValueError(f"{_OWNER}: var_name_to_prev_var_name renames table(s) {renamed_tables}; renaming a table "
                             "is not supported (a table is restored under its own name)")
        for var in dense:
            if _selects(selection, var.op.name, is_table=False):
                dense_from[var] = (path, renames.get(var.op.name, var.op.name))
        for name, table in tables.items():
            if _selects(selection, name, is_table=True):
                tables_from[table] = path
    return dense_from, tables_from


def prepare(settings: Any, graph: tf.Graph | None = None) -> list:
    """Builds, while the graph can still change, the ops warm start needs for its tables."""
    _, tables_from = plan(settings, graph)
    for table in tables_from:
        table.init_ops()


def warm_start(sess: tf.compat.v1.Session, settings: Any) -> None:
    """Session mode: applies `settings` in `sess` (after the variable initializers ran). Every
    rank calls it; each reads the dense values and the table keys it owns (any number of ranks
    may have written the checkpoints)."""
    dense_from, tables_from = plan(settings, sess.graph)
    readers = {}
    for var, (path, name) in dense_from.items():
        path = _resolve(path)
        reader = readers.setdefault(path, tf.train.load_checkpoint(path))
        if not reader.has_tensor(name):
            raise ValueError(f"{_OWNER}: checkpoint {path!r} has no variable {name!r} (for {var.op.name!r})")
        value = reader.get_tensor(name)
        if tuple(value.shape) != tuple(var.shape.as_list()):
            raise ValueError(f"{_OWNER}: {name!r} in {path!r} has shape {list(value.shape)}, "
                             f"{var.op.name!r} has {var.shape.as_list()}")
        var.load(value, sess)
    by_path = {}
    for table, path in tables_from.items():
        by_path.setdefault(_resolve(path), []).append(table)
    # Every checkpoint checked before any row is loaded; like TensorFlow's warm start, optimizer slots start afresh.
    restore_tables(sess, list(by_path.items()), f"{_OWNER} from {sorted(by_path)}", values_only=True)
    config.mark_loaded()
    log.info("warm started %d dense variable(s) and %d table(s) from %d checkpoint(s)", len(dense_from),
             len(tables_from), len(set(p for p, _ in dense_from.values()) | set(by_path)))


class WarmStartHook(tf.compat.v1.train.SessionRunHook):
    """Estimator mode: warm start when training starts without a checkpoint in model_dir (as
    tf.estimator does: a model_dir checkpoint always wins)."""

    def __init__(self, settings, model_dir):
        self._settings = settings
        self._model_dir = model_dir
        self._active = False

    def begin(self) -> None:
        self._active = tf.train.latest_checkpoint(self._model_dir) is None
        if self._active:
            prepare(self._settings)

    def after_create_session(self, session: tf.compat.v1.Session, coord: Any) -> None:
        if self._active:
            warm_start(session, self._settings)
