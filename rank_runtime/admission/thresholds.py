"""A table's admission and eviction thresholds, taken from the training features that look it up
when the key pipeline starts; the native index of every rank gets them before the first batch.

access_threshold t >= 0: a key gets a row once it has occurred t times in training batches, counted
over every rank on the key's owner (0 and 1 admit a key at its first occurrence, but count it);
until then it reads zeros (or serving_default_value) and its gradient is dropped. -1 or None: off,
every key gets a row at once and nothing is counted. eviction_threshold e >= 0: EvictHook evicts
the keys whose last-seen data timestamp is at least e seconds older than the newest one seen.
"""
from dataclasses import dataclass
from typing import Any

from ..formats.channel import Channel
from ..embedding.row_store import row_init


@dataclass(frozen=True)
class Thresholds:
    access: int = -1
    eviction: int = -1
    feature: str = ""  # the training feature they came from, named when another one disagrees

    @classmethod
    def of_spec(cls, spec: Any) -> "Thresholds":
        return cls(spec.access_threshold if spec.admission else -1,
                   spec.eviction_threshold if spec.eviction else -1, spec.name)

    @property
    def counts(self) -> bool:
        return self.access >= 0

    @property
    def evicts(self) -> bool:
        return self.eviction >= 0

    def describe(self) -> str:
        return (f"access_threshold {self.access}, eviction_threshold {self.eviction}" if self.counts
                else "no admission")


def _apply(table, thresholds):
    known = table.thresholds
    if known is not None and (known.access, known.eviction) != (thresholds.access, thresholds.eviction):
        raise ValueError(f"table {table.table_name!r}: training feature {known.feature!r} gives it "
                         f"{known.describe()}, but training feature {thresholds.feature!r} gives it "
                         f"{thresholds.describe()}; a table has one admission and eviction setting: make the "
                         "FeatureSpecs (or access_and_evict_configs) of its training lookups agree")
    if thresholds.evicts and not table.expands and known is None:
        # A fixed table's evicted rows are drawn afresh by the native core when they are reused.
        try:
            init = row_init(table.emb_initializer, table.table_name, table.rank)
        except ValueError as e:
            raise ValueError(f"table {table.table_name!r}: eviction_threshold = {thresholds.eviction} (feature "
                             f"{thresholds.feature!r}) frees rows that later keys reuse with fresh initial values, "
                             f"drawn by the native core from emb_initializer; {e}") from None
        table.store.set_init(init.kind, init.a, init.b, init.seed & (2**64 - 1), float(table.init_param))
    table.set_thresholds(thresholds)


def configure_tables(tables: dict, insert_functions: list) -> None:
    """Sets every table's thresholds from the training features of `insert_functions`; a table
    that no training feature looks up keeps admission off."""
    for insert in insert_functions:
        if insert.channel != Channel.TRAIN:
            continue
        for spec in insert.specs:
            _apply(tables[spec.table_name], Thresholds.of_spec(spec))
