"""shardrec-serve's model side: a shardrec SavedModel loaded once, its tables and dense variables
brought to a training job's newest checkpoint and kept there as the job saves (a delta's changed
rows in place, a full save or a new chain as a fresh session swapped in), each request answered by
one version. The HTTP side (TF Serving's REST API) is http_app.py; the CLI launch/serve_cli.py."""
