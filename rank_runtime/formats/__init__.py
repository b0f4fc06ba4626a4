"""The formats that cross processes and years, with no TensorFlow and no MPI: the checkpoint manifest
and its shard files, the chain of incremental saves, the heartbeat and the supervisor's signals, and
the key pipeline's channels. The supervisor and the command-line tools read them without starting a
rank (tests/test_imports.py holds them to importing nothing heavier than `process.logs`)."""
