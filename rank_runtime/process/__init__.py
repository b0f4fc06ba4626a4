"""One rank's process: init() and its end, what init was given, the MPI world and its communicators,
the environment defaults set before the libraries start, what init() patches in TensorFlow, how a
failing rank ends the job, the heartbeat to the supervisor, logs that carry the rank, and what the key
pipeline's batches mean to their observers (batch_events.py). Each module owns its own state (one
`_STATE`). Importing the package loads none of them."""
