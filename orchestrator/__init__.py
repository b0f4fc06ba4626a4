"""The supervisor's side of a job: what it reads of checkpoints (and, later, watching the ranks).
Never imports TensorFlow, so it starts at once and survives a rank that crashed inside it."""
