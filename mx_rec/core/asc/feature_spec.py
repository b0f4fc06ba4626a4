from shardrec.rank_runtime.pipeline.feature_spec import FeatureSpec

__all__ = ["FeatureSpec"]
