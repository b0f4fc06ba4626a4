"""The saves that the serving tests follow and the oracle they compare with: incremental_job's
chain by 1 and 2 ranks (a pytest fixture, made once a test file), shardrec-export of a checkpoint
loaded afresh by TensorFlow's SavedModel loader, the keys to probe."""
import os

import numpy as np
import pytest
import tensorflow as tf

from mpi_helpers import check, mpiexec

STEPS = (4, 8, 12, 16, 20, 24)
UNSEEN = [10**12, 10**12 + 1]


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    """incremental_job's chain f4,d8,d12,f16,d20,d24 (admissions, evictions, lazy Adam) by 1 and 2
    ranks, and a SavedModel exported from the 2-rank model-4."""
    root = tmp_path_factory.mktemp("live")
    out = {}
    for n in (1, 2):
        out[n] = str(root / f"chain{n}")
        check(mpiexec(n, "incremental_job.py", out[n], "train", "--saves", "f4,d8,d12,f16,d20,d24"))
    out["export"] = export(os.path.join(out[2], "model-4"), root / "export")
    return out


def export(checkpoint, out):
    from live_serving_model import outputs
    from shardrec.rank_runtime import export_saved_model

    export_saved_model(str(checkpoint), str(out), outputs, {"ids": tf.TensorSpec([None], tf.int64)})
    return str(out)


def oracle(checkpoint, work, ids):
    """emb and w of shardrec-export on `checkpoint`, loaded afresh by TensorFlow's SavedModel loader
    (in a graph and session of its own: the tests run with eager execution off)."""
    saved = export(checkpoint, os.path.join(str(work), f"oracle-{os.path.basename(checkpoint)}"))
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        meta = tf.compat.v1.saved_model.load(sess, [tf.saved_model.SERVING], saved)
        signature = meta.signature_def["serving_default"]
        return sess.run({k: signature.outputs[k].name for k in ("emb", "w", "score")},
                        {signature.inputs["ids"].name: ids})


def list_saves(model_dir, paths):
    """What the job's Saver does once every rank committed a save: the state file names it."""
    tf.compat.v1.train.update_checkpoint_state(str(model_dir), paths[-1], list(paths))


def probe_ids(paths):
    """Every key that any of the saves holds or counts (so: keys evicted later, and pending ones)."""
    from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows

    keys = set()
    for path in paths:
        rows = table_rows(find_checkpoints(path)[0], "emb")
        keys.update(rows["keys"].tolist())
        keys.update(rows["pending_keys"].tolist())
    return np.array(sorted(keys) + UNSEEN, np.int64)
