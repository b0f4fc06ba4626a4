from shardrec.rank_runtime.pipeline.feature_spec import FeatureSpec
from shardrec.rank_runtime.pipeline.key_pipeline import get_asc_insert_func

__all__ = ["FeatureSpec", "get_asc_insert_func"]
