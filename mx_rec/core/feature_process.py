from shardrec.rank_runtime.not_built import EvictHook

__all__ = ["EvictHook"]
