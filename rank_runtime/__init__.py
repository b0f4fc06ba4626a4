"""Everything that runs inside one rank: init, tables, lookups, the key pipeline, sparse optimizers."""
from .config import (get_rank_id, get_rank_size, get_use_dynamic_expansion, init,
                     terminate_config_initializer)
from .estimator import Estimator
from .feature_spec import FeatureSpec
from .hooks import GraphModifierHook
from .key_pipeline import get_asc_insert_func, start_asc_pipeline
from .lookup import sparse_lookup
from .saver import Saver
from .table import EmbeddingTable, create_table
from .variables import get_dense_and_sparse_variable

__all__ = [
    "EmbeddingTable", "Estimator", "FeatureSpec", "GraphModifierHook", "Saver", "create_table", "get_asc_insert_func", "get_dense_and_sparse_variable",
    "get_rank_id", "get_rank_size", "get_use_dynamic_expansion", "init", "sparse_lookup", "start_asc_pipeline",
    "terminate_config_initializer",
]
