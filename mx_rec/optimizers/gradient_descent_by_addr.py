# The Rec SDK's name here is create_hash_optimizer_by_addr(learning_rate, weight_decay=0.0001, ...)
# (the lazy Adam and Adagrad modules say "_by_address"); the "_by_address" spelling is kept as well.
from shardrec.rank_runtime.optimizers.by_address import gradient_descent as create_hash_optimizer_by_addr

create_hash_optimizer_by_address = create_hash_optimizer_by_addr

__all__ = ["create_hash_optimizer_by_addr", "create_hash_optimizer_by_address"]
