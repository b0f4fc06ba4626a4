"""What the incremental checkpoint tests share: their job (tests/mpi_jobs/incremental_job.py) and
its tables gathered from every rank's output, compared whole."""
import glob
import os

import numpy as np

JOB = "incremental_job.py"
ARRAYS = ("values", "LazyAdam_m", "LazyAdam_v", "counts", "last_seen")


def gathered(directory, tag, n):
    parts = [np.load(f) for f in sorted(glob.glob(os.path.join(directory, f"{tag}-rank*-of{n}.npz")))]
    assert len(parts) == n
    keys = np.concatenate([p["keys"] for p in parts])
    order = np.argsort(keys)
    out = {"keys": keys[order], **{a: np.concatenate([p[a] for p in parts])[order] for a in ARRAYS}}
    pending = np.concatenate([p["pending_keys"] for p in parts])
    by = np.argsort(pending)
    out["pending"] = np.stack([pending[by], *(np.concatenate([p[f"pending_{a}"] for p in parts])[by].astype(np.int64)
                                              for a in ("counts", "last_seen"))])
    out["w"], out["step"] = parts[0]["w"], parts[0]["step"]
    assert all(np.array_equal(p["w"], out["w"]) for p in parts)
    return out


def assert_same(a, b, what):
    assert len(a["keys"]) > 20, what
    for name in a:
        assert np.array_equal(a[name], b[name]), f"{what}: {name} differs"
