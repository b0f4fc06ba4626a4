"""Export of a large table for serving: a checkpoint of 2 ranks' shards with `--rows` keys of dim
`--dim` (default 36M x 16 = 2.3 GB of rows, over protobuf's 2 GB), written with the checkpoint
format's own writer (no training: the rows are random), then exported with
shardrec.rank_runtime.serving.export.export_saved_model and loaded back by a process that imports
TensorFlow only, which looks up some keys and checks their rows.

    python bench/export.py [--rows 36000000] [--dim 16] [--dir /tmp/shardrec-export-bench]

Prints one JSON line: export seconds, the exporting process's peak RSS, the SavedModel's graph
proto and variables sizes, load seconds and peak RSS of the serving process.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

SERVE = r'''
import sys, time, numpy as np, tensorflow as tf
start = time.monotonic()
model = tf.saved_model.load(sys.argv[1])
loaded = time.monotonic() - start
probe = np.load(sys.argv[2])
emb = model.signatures["serving_default"](ids=tf.constant(probe["keys"]))["emb"].numpy()
assert np.array_equal(emb[:-1], probe["rows"]), "served rows differ from the checkpoint's"
assert not emb[-1].any(), "an unknown key must read zeros"
assert not [m for m in sys.modules if m.split(".")[0] in ("shardrec", "mx_rec", "horovod", "mpi4py")]
# VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec.
print(loaded, [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM")][0])
'''


def write_checkpoint(save_path, rows, dim, ranks=2, seed=0):
    """A shared-layout checkpoint of `ranks` shards (keys owned by key mod ranks) and a dense part
    holding the global step; returns a probe of 1000 keys and their rows."""
    import tensorflow as tf

    from shardrec.rank_runtime.formats import sparse_checkpoint as fmt
    from shardrec.rank_runtime.formats.array_files import write_array
    from shardrec.rank_runtime.formats.manifest import TableEntry

    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, 2**62, int(rows * 1.01)))[:rows]
    rng.shuffle(keys)
    probe_at = rng.choice(rows, 1000, replace=False)
    probe_keys = keys[probe_at]
    probe_rows = np.empty((len(probe_keys), dim), np.float32)
    for rank in range(ranks):
        mine = keys[keys % ranks == rank]

        def writer(folder, mine=mine, rank=rank):
            values = np.random.default_rng(seed + 1 + rank).standard_normal((len(mine), dim), np.float32)
            files = {"keys": write_array(folder, "keys", mine), "values": write_array(folder, "values", values)}
            hit = probe_keys % ranks == rank
            order = np.argsort(mine)
            probe_rows[hit] = values[order[np.searchsorted(mine, probe_keys[hit], sorter=order)]]
            return TableEntry(dim, "int64", len(mine), [], [], files)

        fmt.write_shard(save_path, rank, ranks, 1, {"big": writer}, shared=True)
    fmt.publish(save_path, ranks)  # every rank's shard committed: in place, as the Saver does
    probe = {"keys": np.append(probe_keys, -12345), "rows": probe_rows}
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        with tf.compat.v1.Session() as sess:
            sess.run(step.initializer)
            tf.compat.v1.train.Saver([step]).save(sess, save_path, write_meta_graph=False)
    return probe


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=36_000_000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--dir", default=None, help="where the checkpoint and the SavedModel go (removed afterwards)")
    args = p.parse_args(argv)
    import tensorflow as tf

    from shardrec.rank_runtime import create_table, sparse_lookup
    from shardrec.rank_runtime.serving.export import export_saved_model

    tf.compat.v1.disable_eager_execution()
    work = args.dir or tempfile.mkdtemp(prefix="shardrec-export-bench-")
    os.makedirs(work, exist_ok=True)
    try:
        save_path = os.path.join(work, "model", "model.ckpt-1")
        os.makedirs(os.path.dirname(save_path), exist_ok=True)
        probe = write_checkpoint(save_path, args.rows, args.dim)
        np.savez(os.path.join(work, "probe.npz"), **probe)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        def outputs(features):
            table = create_table(tf.int64, args.dim, "big", tf.compat.v1.zeros_initializer())
            return {"emb": sparse_lookup(table, features["ids"], modify_graph=True)}

        start = time.monotonic()
        out = os.path.join(work, "export")
        summary = export_saved_model(save_path, out, outputs, {"ids": tf.TensorSpec([None], tf.int64)})
        seconds = time.monotonic() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        variables = sum(os.path.getsize(os.path.join(out, "variables", f)) for f in os.listdir(os.path.join(out, "variables")))
        served = subprocess.run([sys.executable, "-c", SERVE, out, os.path.join(work, "probe.npz")],
                                capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
        if served.returncode != 0:
            raise SystemExit(f"serving the export failed:\n{served.stderr[-3000:]}")
        load_s, load_rss = (float(x) for x in served.stdout.split()[-2:])
        print(json.dumps({"rows": args.rows, "dim": args.dim, "row_bytes": summary.tables[0].bytes,
                          "export_s": round(seconds, 1), "export_peak_rss": peak, "rss_before_export": before,
                          "graph_proto_bytes": os.path.getsize(os.path.join(out, "saved_model.pb")),
                          "variables_bytes": variables, "load_s": round(load_s, 1), "load_peak_rss": int(load_rss)}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
