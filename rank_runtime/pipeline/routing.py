"""The seam between the key pipeline and the lookup: one feature's exchange result for one batch.
Its fields are those of the native core's FeatureRouting (native/src/exchange/key_exchange.h), by the same
names.

The key pipeline computes it in the dataset (one native call per batch) and files it in the
dataset element, which must be a dict of tensors for tf.data; the lookup reads it back. This type
is the one place that knows how it is filed: a feature's routing as one packed tensor (tf.data's
first batch of a model of 1,000 features waited 20 s for six tensors a feature, 1.7 s for one),
unpacked by one op in the step's graph; a pooled feature's partials field by field.
"""
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional

import numpy as np
import tensorflow as tf

from ..embedding import native_ops

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
    """Int32 tensors telling the lookup how to move one feature's rows for one batch, filed in the
    dataset element packed: [len(rows), len(expand), len(restore), world, then the fields in order]."""

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

    @staticmethod
    def pack(native: Any) -> np.ndarray:
        """The native core's routing of one feature (numpy fields of these names) as one array."""
        header = np.array([len(native.rows), len(native.expand), len(native.restore), len(native.send_splits)],
                          np.int32)
        return np.concatenate((header, native.rows, native.expand, native.send_splits, native.recv_splits,
                               native.restore, native.ticket))

    @property
    def batch(self) -> str:
        """The op that gave this routing's batch: the same for every feature of one get_next()."""
        op = self.rows.op
        return op.inputs[0].op.name if op.type == "ShardrecRoutingUnpack" else op.name

    @classmethod
    def file_packed(cls, element: Dict[str, Any], feature: str, packed: tf.Tensor) -> None:
        """Files the packed routing tensor of `feature` into the dataset element `element`."""
        packed.set_shape([None])
        element[cls.key(feature, "packed")] = packed

    @classmethod
    def read_from(cls, element, feature, world_size: Optional[int] = None, ids_per_batch: Optional[int] = None):
        """The routing of `feature` in `element` (None when the key pipeline did not file it),
        unpacked; its static shapes where the caller knows them."""
        packed = element.get(cls.key(feature, "packed"))
        if packed is None:
            return None
        routing = cls(*native_ops.routing_unpack(packed))
        return routing.with_static_shapes(world_size, ids_per_batch)


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
