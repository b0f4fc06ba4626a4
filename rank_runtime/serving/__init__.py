"""Serving: a trained model written as a SavedModel of stock TensorFlow ops only.

In a graph an export builds (`export.export_in`, named in `embedding/export_view.py`), `create_table`
returns a `StockTable` and `sparse_lookup` looks ids up in it: a `tf.lookup` hash table from key to row number over a variable of rows, filled
from every rank's shard of the checkpoint. Nothing of shardrec (its op library, MPI, the key
pipeline) is needed to load or serve the result: TF Serving, Triton's TensorFlow backend or
`tf.saved_model.load` serve it as any model.
"""
