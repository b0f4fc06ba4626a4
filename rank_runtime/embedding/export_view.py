"""The graphs a serving export builds, and what their tables are there.

In a graph an export builds (serving/export.py: export_saved_model, Estimator.export_saved_model),
create_table returns the export's stock table, filled from the checkpoint, and sparse_lookup looks
the receiver's ids up in it. The export names the graph it builds (`build_in`); create_table and
sparse_lookup follow the graph they are called in, as every TensorFlow op follows its graph. A
training graph built at the same time, in another thread, is not one of them.
"""
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import tensorflow as tf


class ExportView(Protocol):
    """An export's tables (serving/export.py's ServingExport)."""

    def table(self, name: str, key_dtype: tf.DType, dim: int) -> Any:
        """The stock table `name`, sized from the checkpoint."""

    def lookup(self, table: Any, ids: Any, batch: Any, serving_default_value: Any, name: Optional[str],
               combiner: Optional[str] = None, weights: Any = None) -> tf.Tensor:
        """The stock lookup of `ids` (a tensor, or a FeatureSpec read from `batch`) in `table`."""


@dataclass
class ExportGraphs:
    views: "weakref.WeakKeyDictionary[tf.Graph, ExportView]" = field(default_factory=weakref.WeakKeyDictionary)


_STATE = ExportGraphs()


def build_in(graph: tf.Graph, view: ExportView) -> None:
    """`graph` is an export's: its tables are `view`'s, for as long as the graph lives."""
    if graph in _STATE.views:
        raise RuntimeError("build_in: this graph is already an export's; build each export in a graph of its own")
    _STATE.views[graph] = view


def view_of(graph: Optional[tf.Graph] = None) -> Optional[ExportView]:
    """The export whose graph `graph` (default: the default graph) is, or None: a training graph."""
    return _STATE.views.get(graph if graph is not None else tf.compat.v1.get_default_graph())
