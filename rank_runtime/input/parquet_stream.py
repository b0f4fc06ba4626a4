"""A directory stream of Parquet files, read as batches of columns as ParquetDataset reads them.

The layout and the rules are the TFRecord directory stream's (stream/directory.py): one folder a
partition, root/0/ .. root/<partitions - 1>/; a producer writes a file under a name starting with
"." and renames it into place when it is complete; a partition's files are read in the order of
their names; after idle_timeout_s with nothing new a rank's data ends, which every rank learns in
the same round. A position is (file, rows of it trained), in every checkpoint.

Each file is checked when it is first seen: the declared columns there, each of a type its kind
allows, and of the type it has in the first file this rank read (a message names the file). List
columns ("ids", "floats") come out as RaggedTensors whatever the files hold (a fixed-size list
too): the dataset's signature is fixed before the first file arrives.
"""
from typing import Any, Dict, Iterator, Mapping, Optional

import numpy as np
import pyarrow as pa
import tensorflow as tf

from ..stream.cursor import StreamCursor
from ..stream.directory import DirectoryStream
from ..validation import check_bool, check_int
from .columns import Column, declared
from .parquet import Piece, batch_dataset, batches, file_columns, open_file, read_group, same_types

OWNER = "ParquetDirectoryStream"


class ParquetDirectoryStream(DirectoryStream):
    """Parquet files dropped into root/<partition>/ as a dataset of batches of `batch_size` rows
    ({output: tensor}, columns declared as for ParquetDataset) that ends only when the stream is
    idle for idle_timeout_s (None: never) or the job is asked to stop."""

    def __init__(self, root: str, partitions: int, batch_size: int, columns: Mapping[str, Any],
                 idle_timeout_s: Optional[float] = None, poll_s: float = 0.2, drop_remainder: bool = True):
        super().__init__(root, partitions, idle_timeout_s, poll_s)
        self.batch_size = check_int(OWNER, "batch_size", batch_size, 1, 1 << 24)
        self.drop_remainder = check_bool(OWNER, "drop_remainder", drop_remainder)
        self._wanted = declared(columns, OWNER)
        self.columns = [Column(name, kind, 0, group, slot, width) for name, kind, group, slot, width in self._wanted]
        self._types: Dict[str, pa.DataType] = {}  # each declared column's type in the first file read
        self._first = ""

    def _count_file(self, path: str, partition: str) -> int:
        f = open_file(path, OWNER)
        file_columns(f, path, self._wanted, OWNER)
        if not self._types:
            self._types = {name: f.schema_arrow.field(name).type for name, *_ in self._wanted}
            self._first = path
        else:
            same_types(self._types, f, path, self._first, OWNER)
        return f.metadata.num_rows

    def _pieces(self, cursor: StreamCursor, resume: Optional[str]) -> Iterator[Piece]:
        """The row groups of every file slice this rank reads, from the slice's first row."""
        for path, first, _ in self._file_slices(cursor, resume):
            f = open_file(path, OWNER)
            start = 0
            for g in range(f.metadata.num_row_groups):
                rows = f.metadata.row_group(g).num_rows
                if rows and start + rows > first:
                    yield Piece.of(read_group(f, path, g, rows, self.columns, OWNER), self.columns).cut(max(0, first - start))
                start += rows

    def _read(self, cursor: StreamCursor, resume: Optional[str]) -> Iterator[Dict[str, np.ndarray]]:
        return batches(self._pieces(cursor, resume), self.batch_size, self.drop_remainder, self.columns)

    def _records(self) -> tf.data.Dataset:
        return batch_dataset(self._generator, self.columns, self.batch_size, self.drop_remainder)
