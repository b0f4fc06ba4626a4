from shardrec.rank_runtime.optimizers.adagrad import create_hash_optimizer

__all__ = ["create_hash_optimizer"]
