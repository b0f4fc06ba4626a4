"""Training from a stream that does not end: sources read as tf.data datasets, and the positions
every checkpoint holds so that a restored job reads each record exactly once."""
from .directory import DirectoryStream  # noqa: F401
from .redis_streams import RedisStream, StreamBrokerError  # noqa: F401
from .tfrecord_files import StreamFileError, pack_records  # noqa: F401
