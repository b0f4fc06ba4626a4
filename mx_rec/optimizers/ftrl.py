from shardrec.rank_runtime.optimizers.ftrl import create_hash_optimizer

__all__ = ["create_hash_optimizer"]
