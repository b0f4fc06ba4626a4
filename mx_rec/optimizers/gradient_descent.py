from shardrec.rank_runtime.optimizers.gradient_descent import create_hash_optimizer

__all__ = ["create_hash_optimizer"]
