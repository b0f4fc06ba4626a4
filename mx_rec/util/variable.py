from shardrec.rank_runtime.variables import get_dense_and_sparse_variable

__all__ = ["get_dense_and_sparse_variable"]
