from shardrec.rank_runtime.lookup import sparse_lookup
from shardrec.rank_runtime.table import create_table

__all__ = ["create_table", "sparse_lookup"]
