"""Feature admission and eviction (the user guide's "Model Adaptation"): which thresholds a table has, and EvictHook, which
says when every rank evicts. The counting itself is the native core's (embedding_index.h, on the
owner rank inside the key exchange); this room only configures it and triggers it."""
from .evict_hook import EvictHook
from .thresholds import Thresholds, configure_tables

__all__ = ["EvictHook", "Thresholds", "configure_tables"]
