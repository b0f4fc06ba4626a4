"""The Estimator users of the Rec SDK know as NPUEstimator (tf_adapter), here for CPU/GPU ranks."""
from shardrec.rank_runtime.estimator.estimator import Estimator

NPUEstimator = Estimator

__all__ = ["Estimator", "NPUEstimator"]
