"""The seam between the key pipeline and the lookup: one feature's exchange result for one batch.
Its fields are those of the native core's FeatureRouting (native/src/exchange/key_exchange.h), by the same
names.

The key pipeline computes it in the dataset (one native call per batch) and files it in the
dataset element, which must be a dict of tensors for tf.data; the lookup reads it back. This type
is the one place that knows how it is filed.
"""
from dataclasses import dataclass, fields

import tensorflow as tf

_PREFIX = "_shardrec"


@dataclass(frozen=True)
class FeatureRouting:
    """Int32 tensors telling the lookup how to move one feature's rows for one batch."""

    rows: tf.Tensor         # the distinct local rows this rank gathers for its requesters
    expand: tf.Tensor       # per received key, its row among `rows` (empty with one rank, dynamic shapes)
    send_splits: tf.Tensor  # [world size]: rows going out to each requester
    recv_splits: tf.Tensor  # [world size]: rows coming back from each owner
    restore: tf.Tensor      # per id of the batch: its row among those that come back
    ticket: tf.Tensor       # [1]: the batch's number on its table and channel (rows in flight stay in memory)

    @staticmethod
    def names():
        return tuple(f.name for f in fields(FeatureRouting))

    @staticmethod
    def shapes(world_size, ids_per_batch):
        return {"rows": [None], "expand": [None], "send_splits": [world_size], "recv_splits": [world_size],
                "restore": [ids_per_batch],
                "ticket": [1]}

    @staticmethod
    def key(feature, field):
        return f"{_PREFIX}/{feature}/{field}"

    def file_into(self, element, feature):
        """Files this routing into the dataset element `element` (a dict) under `feature`."""
        for name in self.names():
            element[self.key(feature, name)] = getattr(self, name)

    @classmethod
    def read_from(cls, element, feature):
        """The routing of `feature` in `element`, or None when the key pipeline did not process it."""
        keys = {name: cls.key(feature, name) for name in cls.names()}
        if not all(k in element for k in keys.values()):
            return None
        return cls(**{name: element[k] for name, k in keys.items()})

    @classmethod
    def placeholders(cls, world_size, ids_per_batch):
        """Placeholders standing for a routing that graph modification wires in later."""
        shapes = cls.shapes(world_size, ids_per_batch)
        return cls(**{name: tf.compat.v1.placeholder(tf.int32, shapes[name], name=name) for name in cls.names()})

    def with_static_shapes(self, world_size, ids_per_batch):
        shapes = self.shapes(world_size, ids_per_batch)
        for name in self.names():
            getattr(self, name).set_shape(shapes[name])
        return self
