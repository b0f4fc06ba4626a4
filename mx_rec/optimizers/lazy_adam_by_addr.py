from shardrec.rank_runtime.optimizers.by_address import lazy_adam as create_hash_optimizer_by_address

__all__ = ["create_hash_optimizer_by_address"]
