from shardrec.rank_runtime.optimizers.lazy_adam import create_hash_optimizer

__all__ = ["create_hash_optimizer"]
