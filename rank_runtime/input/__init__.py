"""Columnar input: Parquet files read with Apache Arrow's reader as batches of columns, with the
positions of the streams (stream/) in every checkpoint."""
