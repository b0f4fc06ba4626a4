from shardrec.rank_runtime.pipeline.lookup import sparse_lookup
from shardrec.rank_runtime.embedding.table import create_table

__all__ = ["create_table", "sparse_lookup"]
