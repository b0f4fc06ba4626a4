from shardrec.rank_runtime.config import (get_rank_id, get_rank_size, get_use_dynamic_expansion, init,
                                 terminate_config_initializer)
from shardrec.rank_runtime.graph_modifier import get_initializer

__all__ = ["get_initializer", "get_rank_id", "get_rank_size", "get_use_dynamic_expansion", "init",
           "terminate_config_initializer"]
