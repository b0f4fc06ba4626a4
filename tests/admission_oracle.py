"""A plain-Python model of admission and eviction, the oracle of test_admission.py (and of the SSD
tier's evictions in test_tiers.py): per training step, what every key's count and last-seen timestamp
are, which keys have a row, which were admitted in that step, and which were evicted before it; and
the job (tests/mpi_jobs/admission_train.py) run and checked against it."""
import sys

import numpy as np

from mpi_helpers import JOBS, check, mpiexec

sys.path.insert(0, JOBS)
import admission_train as job  # noqa: E402


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


STEP_EVICTIONS = {s for s in range(1, job.STEPS) if s % job.STEP_INTERVAL == 0}


def run_job(out, ranks, mode, *args, tag=None):
    check(mpiexec(ranks, "admission_train.py", out, mode, *args, *(["--tag", tag] if tag else []), timeout=600))
    return [dict(np.load(out / f"{tag or mode}-rank{r}.npz")) for r in range(ranks)]


def joined(parts, name):
    return np.concatenate([p[name] for p in parts])


def by_key(parts, key_name, *names):
    keys = joined(parts, key_name).tolist()
    assert len(keys) == len(set(keys)), "a key is held by two ranks"
    return {k: tuple(v) for k, v in zip(keys, zip(*(joined(parts, n).tolist() for n in names)))}


def check_against_oracle(parts, mode, evict_before):
    """The table's keys, counts, last-seen timestamps and pending keys at the end, and every
    training lookup's rows (zeros before admission, the initial value in the step of admission)."""
    ids, ts = job.stream()
    access, eviction = job.THRESHOLDS[mode]
    model, admitted, held = run(ids, ts, access, eviction, evict_before)
    assert by_key(parts, "keys", "counts", "last_seen") == {k: tuple(v) for k, v in model.rows.items()}
    assert by_key(parts, "pending_keys", "pending_counts", "pending_last_seen") == {
        k: tuple(v) for k, v in model.pending.items()}
    zeros = fresh = 0
    for part in parts:
        start = int(part["start"])
        for j, (step_ids, rows) in enumerate(zip(part["ids"], part["embs"])):
            s = start + j
            for key, row in zip(step_ids.reshape(-1).tolist(), rows.reshape(-1, job.DIM)):
                if key in admitted[s]:
                    np.testing.assert_array_equal(row, job.INIT, err_msg=f"key {key} admitted at step {s}")
                    fresh += 1
                elif key not in held[s]:
                    np.testing.assert_array_equal(row, 0.0, err_msg=f"key {key} not admitted at step {s}")
                    zeros += 1
    assert zeros > 0 and fresh > 0
    return model
