"""shardrec-serve's model side: a shardrec SavedModel loaded once, its tables and dense variables
brought to a training job's newest checkpoint and kept there as the job saves (a delta's changed
rows in place, a full save or a new chain as a fresh session swapped in), each request answered by
one version. A request once read: predictor.py (versions, checks of feeds.py, batching.py); the
APIs: TF Serving's REST (http_app.py, rest_api.py) and gRPC (grpc_api.py); the CLI
launch/serve_cli.py."""
