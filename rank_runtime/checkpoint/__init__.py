"""Checkpoints of the sparse tables beside TensorFlow's: the Saver, each table's save and restore,
the round in which every rank agrees a save or a restore succeeded, which checkpoint is the latest,
the incremental schedule (full or delta), and multi-path warm start. The files themselves are
`formats/`'s."""
