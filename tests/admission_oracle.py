"""A plain-Python model of admission and eviction, the oracle of test_admission.py: per training
step, what every key's count and last-seen timestamp are, which keys have a row, which were admitted
in that step, and which were evicted before it."""
import numpy as np


class Model:
    def __init__(self, access, eviction):
        self.access, self.eviction = access, eviction
        self.rows = {}      # key -> [count, last seen]
        self.pending = {}   # key -> [count, last seen]
        self.newest = -1
        self.evicted = []   # (step, key) of keys with a row
        self.rejected = 0   # occurrences of keys that had no row in their step

    def evict(self, step):
        cutoff = self.newest - self.eviction
        for table in (self.rows, self.pending):
            for key in [k for k, (_, seen) in table.items() if seen <= cutoff]:
                del table[key]
                if table is self.rows:
                    self.evicted.append((step, key))

    def step(self, ids, ts):
        """One global batch: ids [batch, n], ts [batch]. Returns the keys admitted by this batch."""
        counts, seen = {}, {}
        for sample, t in zip(ids, ts):
            for key in sample.tolist():
                counts[key] = counts.get(key, 0) + 1
                seen[key] = max(seen.get(key, -1), int(t))
        admitted = set()
        for key, c in counts.items():
            if key in self.rows:
                row = self.rows[key]
                row[0] += c
                row[1] = max(row[1], seen[key])
                continue
            count, last = self.pending.pop(key, (0, -1))
            entry = [count + c, max(last, seen[key])]
            if entry[0] >= self.access:
                self.rows[key] = entry
                admitted.add(key)
            else:
                self.pending[key] = entry
                self.rejected += c
        self.newest = max(self.newest, int(ts.max()))
        return admitted


def run(ids, ts, access, eviction, evict_before, steps=None):
    """Replays global batches `steps` (default all); evictions happen before the batches whose
    step is in `evict_before`. Returns (model, [admitted keys per step], [keys with a row before each step])."""
    model = Model(access, eviction)
    admitted, held = [], []
    for s in steps if steps is not None else range(len(ids)):
        if s in evict_before:
            model.evict(s)
        held.append(set(model.rows))
        admitted.append(model.step(np.asarray(ids[s]), np.asarray(ts[s])))
    return model, admitted, held
