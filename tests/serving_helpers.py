"""Serving a SavedModel the way a user's serving system does: in a process of its own that imports
TensorFlow only (serve_saved_model.py)."""
import glob
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def serve(export_dir, inputs: dict, work_dir) -> dict:
    """The serving_default outputs for `inputs` (name -> array), from a fresh process; fails when
    anything of shardrec, mx_rec, Horovod or MPI got loaded there."""
    work_dir = str(work_dir)
    np.savez(os.path.join(work_dir, "inputs.npz"), **inputs)
    out = os.path.join(work_dir, "outputs.npz")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH="")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "serve_saved_model.py"), str(export_dir),
                           os.path.join(work_dir, "inputs.npz"), out], capture_output=True, text=True, env=env,
                          cwd=work_dir, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = dict(np.load(out, allow_pickle=False))
    loaded = outputs.pop("loaded_modules").tolist()
    assert loaded == [], f"the serving process loaded {loaded}"
    return outputs


def the_export(export_base) -> str:
    """The one timestamped SavedModel that Estimator.export_saved_model wrote under export_base."""
    found = glob.glob(os.path.join(str(export_base), "*", "saved_model.pb"))
    assert len(found) == 1, found
    return os.path.dirname(found[0])
