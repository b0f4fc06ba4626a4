from shardrec.rank_runtime.graph_modifier import modify_graph_and_start_emb_cache
from shardrec.rank_runtime.hooks import GraphModifierHook

__all__ = ["GraphModifierHook", "modify_graph_and_start_emb_cache"]
