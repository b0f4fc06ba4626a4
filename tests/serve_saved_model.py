"""Loads a SavedModel and predicts, in a process that imports TensorFlow and numpy only: what a
serving system that knows nothing of shardrec does. Run as a script by tests/test_serving.py.

    python serve_saved_model.py EXPORT_DIR INPUTS.npz OUTPUTS.npz

Writes the serving_default signature's outputs for INPUTS' arrays, and `loaded_modules`: the
modules and shared objects of shardrec, mx_rec, horovod, mpi4py or MPI found loaded afterwards."""
import os
import sys

import numpy as np
import tensorflow as tf

_FOREIGN = ("shardrec", "mx_rec", "horovod", "mpi4py")


def main(export_dir, inputs_path, outputs_path):
    model = tf.saved_model.load(export_dir)
    serve = model.signatures["serving_default"]
    inputs = dict(np.load(inputs_path, allow_pickle=False))
    outputs = {k: v.numpy() for k, v in serve(**{k: tf.constant(v) for k, v in inputs.items()}).items()}
    modules = [m for m in sys.modules if m.split(".")[0] in _FOREIGN]
    with open(f"/proc/{os.getpid()}/maps") as f:
        libraries = sorted({line.split()[-1] for line in f if "tf_ops" in line or "libmpi" in line
                            or "shardrec" in line})
    np.savez(outputs_path, **outputs, loaded_modules=np.array(modules + libraries, dtype=str))


if __name__ == "__main__":
    main(*sys.argv[1:4])
