from shardrec.rank_runtime.embedding.variables import get_dense_and_sparse_variable

__all__ = ["get_dense_and_sparse_variable"]
