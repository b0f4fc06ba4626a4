from shardrec.rank_runtime.feature_spec import FeatureSpec

__all__ = ["FeatureSpec"]
