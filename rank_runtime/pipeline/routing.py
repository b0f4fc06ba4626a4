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


class _Filed:
    """Filing a routing's int32 tensors into the dataset element, under the feature's name."""
    _part = ""

    @classmethod
    def names(cls):
        return tuple(f.name for f in fields(cls))

    @classmethod
    def key(cls, feature, field):
        return f"{_PREFIX}/{feature}/{cls._part}{field}"

    def file_into(self, element, feature):
        """Files this routing into the dataset element `element` (a dict) under `feature`."""
        for name in self.names():
            element[self.key(feature, name)] = getattr(self, name)

    @classmethod
    def read_from(cls, element, feature):
        """The routing of `feature` in `element`, or None when the key pipeline did not file it."""
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


@dataclass(frozen=True)
class FeatureRouting(_Filed):
    """Int32 tensors telling the lookup how to move one feature's rows for one batch."""

    rows: tf.Tensor         # the distinct local rows this rank gathers for its requesters
    expand: tf.Tensor       # per received key, its row among `rows` (empty with one rank, dynamic shapes)
    send_splits: tf.Tensor  # [world size]: rows going out to each requester
    recv_splits: tf.Tensor  # [world size]: rows coming back from each owner
    restore: tf.Tensor      # per id of the batch: its row among those that come back
    ticket: tf.Tensor       # [1]: the batch's number on its table and channel (rows in flight stay in memory)

    @staticmethod
    def shapes(world_size, ids_per_batch):
        return {"rows": [None], "expand": [None], "send_splits": [world_size], "recv_splits": [world_size],
                "restore": [ids_per_batch],
                "ticket": [1]}


@dataclass(frozen=True)
class PoolRouting(_Filed):
    """A pooled (variable-length) feature's partials for one batch: native/src/exchange/pooling.h's
    PoolRouting, by the same names. Owner side: `occ_*` of the ids it received, `partial_send_splits`;
    requester side: the rest."""
    _part = "pool/"

    occ_rows: tf.Tensor             # owner: per id received, its row among FeatureRouting.rows
    occ_segments: tf.Tensor         # owner: per id received, the partial it adds to (nondecreasing)
    partial_send_splits: tf.Tensor  # owner: [world size]: partials going back to each requester
    occ_recv_splits: tf.Tensor      # owner: [world size]: ids (and weights) received from each requester
    partial_recv_splits: tf.Tensor  # requester: [world size]: partials coming back from each owner
    partial_index: tf.Tensor        # requester: per (example, owner) pair, the partial it reads (empty: identity)
    partial_examples: tf.Tensor     # requester: per (example, owner) pair, its example
    occ_order: tf.Tensor            # requester: per id sent (owner order), its index among the batch's ids
    occ_send_splits: tf.Tensor      # requester: [world size]: ids sent to each owner

    @staticmethod
    def shapes(world_size, ids_per_batch):
        splits = ("partial_send_splits", "occ_recv_splits", "partial_recv_splits", "occ_send_splits")
        return {name: [world_size] if name in splits else [None] for name in PoolRouting.names()}
