"""Estimator mode: shardrec's Estimator (the Rec SDK's NPUEstimator) and the session hook that
modifies the graph and starts the key pipeline."""
