"""The record count of a complete TFRecord file, read from its framing (a record is an 8-byte
length, its 4-byte CRC, the data, the data's 4-byte CRC). The stream's positions are record
counts, so every file is counted when it is handed to tf.data; a file whose framing does not add
up to its size (cut short, or not TFRecord) is refused by name and offset before any of it is
trained, and so is a file with a record whose CRC does not match: TensorFlow's reader checks them
too, but names neither the file nor the partition. The count is native
(storage/tfrecord_framing.h, in the framing module, which links no MPI, so that producers and
scripts may use it): a Python loop over the records cost the directory stream a tenth of its
samples/s (bench/README.md)."""
from typing import Iterable
from ...native import framing


class StreamFileError(ValueError):
    """A stream file that cannot be read as complete records."""


def count_records(path: str, partition: str) -> int:
    counted = framing.count_tfrecords(path, check_crc=True)
    if counted.bad_offset < 0:
        return counted.records
    if counted.bad_crc:
        raise StreamFileError(f"stream partition {partition!r}: {path}: record {counted.records} at byte "
                              f"{counted.bad_offset} ({counted.bad_length} bytes): the CRC of its {counted.bad_crc} "
                              "does not match, the file is damaged; none of it was trained: put an intact copy in its "
                              "place (under another name, then renamed over it), or remove it to skip its records")
    if counted.bad_length < 0:
        raise StreamFileError(f"stream partition {partition!r}: {path} ends inside the header of record "
                              f"{counted.records} (byte {counted.bad_offset} of {counted.size}); a stream file must "
                              "be complete when it appears (write it under another name and rename it into the "
                              "partition)")
    raise StreamFileError(f"stream partition {partition!r}: {path}: record {counted.records} at byte "
                          f"{counted.bad_offset} says {counted.bad_length} bytes, past the file's end ({counted.size} "
                          "bytes): the file is cut short or not TFRecord")


def pack_records(records: Iterable[bytes]) -> bytes:
    """The bytes of a TFRecord file that holds `records` (a sequence of bytes): what a producer
    appends to a Redis stream as one packed entry (XADD <name>:<p> * records <these bytes>), or
    writes to a directory stream as a file. The same bytes as tf.io.TFRecordWriter writes."""
    return framing.pack_tfrecords(records)
