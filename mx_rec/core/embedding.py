from rank_runtime.lookup import sparse_lookup
from rank_runtime.table import create_table

__all__ = ["create_table", "sparse_lookup"]
