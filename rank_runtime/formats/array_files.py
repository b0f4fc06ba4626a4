"""A checkpoint's array files: .npy files (a small header and raw data), each described in its shard's
manifest by an entry (file, bytes, CRC-32, dtype, shape) and read back only when it matches it:
whole (read_array), a chunk at a time with the checksum on the way (stream_array), or, once
verified, through a mapping of the page cache (map_array). Read with numpy's header parser and
never with pickle: nothing in a checkpoint can execute. The shard layout around them is
sparse_checkpoint.py's."""
import io
import mmap
import os
import zlib
from dataclasses import dataclass
from typing import Tuple

import numpy as np

MANIFEST = "MANIFEST.json"
CHUNK = 64 * 2**20  # bytes read at a time
# A table's 16-bit rows (embedding/row_dtypes.py) are written as the store holds them: float16 as
# numpy's '<f2', bfloat16 (which numpy lacks) as its raw bits, an .npy of '<u2' that the manifest
# names bfloat16. Both are read back as float32, exactly (every 16-bit number is a float32 one):
# whatever reads a checkpoint's rows sees float32, and a store of 16-bit rows takes them back
# to the same 16 bits.
BFLOAT16 = "bfloat16"
_NPY_DTYPE = {BFLOAT16: "<u2"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored: missing, incomplete, corrupt or of another layout."""


@dataclass(frozen=True)
class ArrayEntry:
    """A manifest's entry for one array file: its path (relative to the shard once in a manifest,
    to its table's folder as a writer returns it), size, CRC-32, dtype and shape."""
    file: str
    bytes: int
    crc32: int
    dtype: str
    shape: Tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 0

    def to_json(self) -> dict:
        return {"file": self.file, "bytes": self.bytes, "crc32": self.crc32, "dtype": self.dtype,
                "shape": list(self.shape)}

    def moved_into(self, folder: str) -> "ArrayEntry":
        """The entry with its file named from the shard's directory (a writer names it from its table's folder)."""
        return ArrayEntry(f"{folder}/{self.file}", self.bytes, self.crc32, self.dtype, self.shape)


def array_entry(file: str, nbytes: int, crc: int, dtype: str, shape: tuple) -> ArrayEntry:
    """The entry of an array file written elsewhere (the native core writes a table's rows)."""
    return ArrayEntry(file, int(nbytes), int(crc), dtype, tuple(int(d) for d in shape))


def write_array(directory: str, name: str, array: np.ndarray) -> ArrayEntry:
    """Writes `array` as <directory>/<name>.npy (not flushed: write_shard flushes a shard's files
    together); returns its manifest entry."""
    array = np.ascontiguousarray(array)
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, np.lib.format.header_data_from_array_1_0(array))
    header = buffer.getvalue()
    data = memoryview(array.reshape(-1)).cast("B") if array.size else memoryview(b"")  # type: ignore[arg-type]
    path = os.path.join(directory, f"{name}.npy")
    with open(path, "wb") as f:
        f.write(header)
        f.write(data)
    return array_entry(f"{name}.npy", len(header) + data.nbytes, zlib.crc32(data, zlib.crc32(header)),
                       array.dtype.str, array.shape)


def file_of(shard_dir: str, entry: ArrayEntry, what: str) -> str:
    """The path of a manifest's file entry, which must lie in a table folder of the shard."""
    path = os.path.normpath(os.path.join(shard_dir, entry.file))
    if os.path.dirname(os.path.dirname(path)) != os.path.normpath(shard_dir):
        raise CheckpointError(f"{shard_dir}/{MANIFEST}: file {entry.file!r} of {what} lies outside the shard")
    return path


def checked_size(path: str, entry: ArrayEntry, what: str) -> int:
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing ({what})") from None
    if size != entry.bytes:
        raise CheckpointError(f"{path}: {size} bytes, the manifest says {entry.bytes} ({what}; truncated or "
                              "replaced)")
    return size


def crc_of(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                return crc
            crc = zlib.crc32(chunk, crc)


def parse_header(path, stream, entry):
    """(shape, dtype) from an .npy header at the stream's position, checked against the manifest."""
    try:
        version = np.lib.format.read_magic(stream)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(stream)
    except ValueError as e:
        raise CheckpointError(f"{path}: not an array file ({e})") from None
    if tuple(shape) != entry.shape or dtype.str != _NPY_DTYPE.get(entry.dtype, entry.dtype) or fortran or dtype.hasobject:
        raise CheckpointError(f"{path}: holds {dtype.str}{list(shape)}, the manifest says {entry.dtype}{list(entry.shape)}")
    return shape, dtype


def stream_array(shard_dir: str, entry: ArrayEntry, what: str, chunk_bytes: int = CHUNK):
    """Yields (first row, rows) of one array of a shard, a chunk at a time, checked against its
    manifest entry on the way: size and header before the first chunk, the CRC-32 after the last
    (a CheckpointError then; what was yielded came from a damaged file). Each chunk lives in one
    reused buffer: use it before asking for the next."""
    path = file_of(shard_dir, entry, what)
    checked_size(path, entry, what)
    with open(path, "rb", buffering=0) as f:
        head = f.read(4096)
        stream = io.BytesIO(head)
        shape, dtype = parse_header(path, stream, entry)
        data_start = stream.tell()
        crc = zlib.crc32(memoryview(head)[:data_start])
        row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        # No larger than the file: a zeroed 64 MiB buffer costs 20 ms, more than a small file's read.
        chunk_rows = min(chunk_bytes // max(row_bytes, 1), int(shape[0]) if len(shape) else 1)
        buf = bytearray(max(row_bytes, chunk_rows * row_bytes))
        view = memoryview(buf)
        carried = len(head) - data_start  # data bytes read with the header
        view[:carried] = memoryview(head)[data_start:]
        first = 0
        while True:
            got = carried
            while got < len(buf):
                n = f.readinto(view[got:])
                if not n:
                    break
                got += n
            carried = 0
            usable = got - got % row_bytes if row_bytes else got
            if usable:
                crc = zlib.crc32(view[:usable], crc)
                rows = usable // row_bytes
                yield first, as_float32(np.frombuffer(buf, dtype=dtype, count=rows * (row_bytes // dtype.itemsize))
                                        .reshape((rows, *shape[1:])), entry)
                first += rows
            if got < len(buf):
                crc = zlib.crc32(view[usable:got], crc)
                break
    if crc != entry.crc32 or first != shape[0]:
        raise CheckpointError(f"{path}: checksum mismatch ({what}); the file is corrupt")


def map_array(shard_dir: str, entry: ArrayEntry, what: str, chunk_bytes: int = CHUNK):
    """stream_array's chunks for a file verified before (stream_array), without its checksum: read
    through a read-only mapping of the page cache instead of copied into a buffer, each chunk's
    pages dropped from the mapping once used, so that a mapped file never counts whole in the
    process's memory."""
    path = file_of(shard_dir, entry, what)
    checked_size(path, entry, what)
    with open(path, "rb") as f:
        # Unmapped when the last chunk handed out is gone (a chunk holds the mapping).
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    stream = io.BytesIO(mapped[:4096])
    shape, dtype = parse_header(path, stream, entry)
    start = stream.tell()
    row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, chunk_bytes // max(row_bytes, 1))
    dropped = 0
    for first in range(0, shape[0], step):
        rows = min(step, shape[0] - first)
        yield first, as_float32(np.frombuffer(mapped, dtype=dtype, count=rows * (row_bytes // dtype.itemsize),
                                              offset=start + first * row_bytes).reshape((rows, *shape[1:])), entry)
        end = (start + (first + rows) * row_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > dropped:
            mapped.madvise(mmap.MADV_DONTNEED, dropped, end - dropped)
            dropped = end


def read_array(shard_dir: str, entry: ArrayEntry, what: str) -> np.ndarray:
    """Reads one array of a shard and checks it against its manifest entry."""
    path = file_of(shard_dir, entry, what)
    size = checked_size(path, entry, what)
    buf = bytearray(size)
    with open(path, "rb") as f:
        f.readinto(buf)
    if zlib.crc32(buf) != entry.crc32:
        raise CheckpointError(f"{path}: checksum mismatch ({what}); the file is corrupt")
    stream = io.BytesIO(buf)
    shape, dtype = parse_header(path, stream, entry)
    return as_float32(np.frombuffer(buf, dtype=dtype, offset=stream.tell()).reshape(shape), entry)


def as_float32(array: np.ndarray, entry: ArrayEntry) -> np.ndarray:
    """16-bit rows as float32 (exact); any other array as it is."""
    if entry.dtype == "<f2":
        return array.astype(np.float32)
    if entry.dtype == BFLOAT16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array
