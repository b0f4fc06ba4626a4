"""Which rows of a served table's values variable hold keys, which are free, and where the row of
zeros is that keys without a row read (the export's row count: a constant in the SavedModel's
graph, so it never moves). Rows of evicted keys are reused by new ones; the variable grows by
doubling when none is free. Numpy only: no Python object per key."""
import numpy as np


class RowSlots:
    def __init__(self, zero_row: int, capacity: int, used_rows: np.ndarray):
        self.zero_row = zero_row
        self.capacity = capacity
        taken = np.zeros(capacity, bool)
        taken[used_rows] = True
        taken[zero_row] = True
        self.free = np.flatnonzero(~taken)

    @staticmethod
    def first_fill(zero_row: int, count: int) -> tuple:
        """(rows for `count` keys, capacity): rows 0.. in order except the zero row; the key that
        would land on it goes to the end instead, so that rows read in order need no copy. An
        eighth more rows are free for new keys: growing copies the table."""
        rows = np.arange(count, dtype=np.int64)
        if count > zero_row:
            rows[zero_row] = count
        return rows, max(count, zero_row) + 1 + count // 8 + 1024

    def take(self, count: int, freed: np.ndarray) -> tuple:
        """(rows for `count` new keys, the capacity needed): `freed` rows (of keys removed by the
        same update) join the free ones first."""
        free = np.concatenate([np.asarray(freed, np.int64), self.free])
        if count > len(free):
            grown = max(self.capacity * 2, self.capacity + count - len(free))
            free = np.concatenate([free, np.arange(self.capacity, grown, dtype=np.int64)])
            self.capacity = grown
        rows, self.free = free[:count], free[count:]
        return rows, self.capacity
