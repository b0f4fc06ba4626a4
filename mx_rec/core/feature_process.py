from shardrec.rank_runtime.admission import EvictHook

__all__ = ["EvictHook"]
