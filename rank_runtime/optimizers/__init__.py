"""Sparse optimizers for shardrec tables: each module offers create_hash_optimizer(...)."""
