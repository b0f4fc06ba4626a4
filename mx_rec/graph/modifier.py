from shardrec.rank_runtime.pipeline.graph_modifier import modify_graph_and_start_emb_cache
from shardrec.rank_runtime.estimator.hooks import GraphModifierHook

__all__ = ["GraphModifierHook", "modify_graph_and_start_emb_cache"]
