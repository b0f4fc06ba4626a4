from shardrec.rank_runtime.not_built import create_hash_optimizer_by_address

__all__ = ["create_hash_optimizer_by_address"]
