"""The record count of a complete TFRecord file, read from its framing (a record is an 8-byte
length, its 4-byte CRC, the data, the data's 4-byte CRC). The stream's positions are record
counts, so every file is counted when it is handed to tf.data; a file whose framing does not add
up to its size (cut short, or not TFRecord) is refused by name and offset before any of it is
trained. The CRCs themselves are checked by TensorFlow's reader as it reads."""
import os
import struct

HEADER = struct.Struct("<Q")
FRAME_BYTES = 8 + 4 + 4


class StreamFileError(ValueError):
    """A stream file that cannot be read as complete records."""


def count_records(path: str, partition: str) -> int:
    size = os.path.getsize(path)
    count, offset = 0, 0
    with open(path, "rb") as f:
        while offset < size:
            f.seek(offset)
            header = f.read(8)
            if len(header) < 8:
                raise StreamFileError(f"stream partition {partition!r}: {path} ends inside the header of record {count} "
                                      f"(byte {offset} of {size}); a stream file must be complete when it appears "
                                      "(write it under another name and rename it into the partition)")
            (length,) = HEADER.unpack(header)
            end = offset + FRAME_BYTES + length
            if end > size:
                raise StreamFileError(f"stream partition {partition!r}: {path}: record {count} at byte {offset} says "
                                      f"{length} bytes, past the file's end ({size} bytes): the file is cut short or "
                                      "not TFRecord")
            offset, count = end, count + 1
    return count
