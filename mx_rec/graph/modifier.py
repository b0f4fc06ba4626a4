from rank_runtime.not_built import GraphModifierHook, modify_graph_and_start_emb_cache

__all__ = ["GraphModifierHook", "modify_graph_and_start_emb_cache"]
