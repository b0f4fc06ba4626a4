from shardrec.rank_runtime.process.config import (get_config, get_if_load, get_rank_id, get_rank_size,
                                          get_use_dynamic_expansion, set_if_load)
from shardrec.rank_runtime.process.lifecycle import init, terminate_config_initializer
from shardrec.rank_runtime.pipeline.graph_modifier import get_initializer

__all__ = ["ConfigInitializer", "get_if_load", "get_initializer", "get_rank_id", "get_rank_size",
           "get_use_dynamic_expansion", "init", "set_if_load", "terminate_config_initializer"]


class ConfigInitializer:
    """The Rec SDK's view of init()'s settings: `ConfigInitializer.get_instance().if_load`."""

    _instance = None

    @classmethod
    def get_instance(cls):
        get_config()  # not initialised: the same error as every other call
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    @property
    def if_load(self):
        return get_if_load()

    @property
    def rank_id(self):
        return get_rank_id()

    @property
    def rank_size(self):
        return get_rank_size()

    @property
    def use_dynamic_expansion(self):
        return get_use_dynamic_expansion()
