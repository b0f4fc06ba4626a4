"""Session hooks for Estimator mode."""
from typing import Any
import tensorflow as tf

from ..process import config
from ..admission.steps import follow_global_step
from ..pipeline.graph_modifier import modify_graph_and_start_emb_cache
from ..pipeline.key_pipeline import start_asc_pipeline
from ..validation import check_bool


class GraphModifierHook(tf.compat.v1.train.SessionRunHook):
    """Does, for the graph of each Estimator call (train, evaluate, predict), what a tf.Session
    script does by hand: graph modification (or, with modify_graph=False, start_asc_pipeline)
    before the session exists, and the new iterators' initializers once it does."""

    def __init__(self, dump_graph=False, modify_graph=True):
        self._dump_graph = check_bool("GraphModifierHook", "dump_graph", dump_graph)
        self._modify_graph = check_bool("GraphModifierHook", "modify_graph", modify_graph)
        self._initializers = []

    def begin(self) -> None:
        state = config.get_config().graph_state()
        if self._modify_graph and (state.pending_lookups or not state.initializers):
            modify_graph_and_start_emb_cache(dump_graph=self._dump_graph)
        elif not state.pipeline_started:
            start_asc_pipeline()
        # Another GraphModifierHook of the same call may have modified the graph already.
        self._initializers = list(state.initializers.values())

    def after_create_session(self, session: tf.compat.v1.Session, coord: Any) -> None:
        if self._initializers:
            session.run(self._initializers)
        follow_global_step(session, config.get_config().graph_state(session.graph).tables.values())
