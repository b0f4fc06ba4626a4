"""shardrec-ckpt inspect against checkpoints the Saver wrote: what it lists, and that it finds
damage (the reader in orchestrator/ must agree with the writer in rank_runtime/)."""
import os
import shutil
import subprocess
import sys

import numpy as np
import tensorflow as tf

CLI = os.path.join(os.path.dirname(sys.executable), "shardrec-ckpt")


def _save(directory):
    from mx_rec.optimizers import lazy_adam
    from rank_runtime import create_table

    table = create_table(tf.int64, 8, "user_table", tf.compat.v1.zeros_initializer(), device_vocabulary_size=50)
    grad = tf.IndexedSlices(tf.ones([1, 8]), tf.constant([0], tf.int32), tf.constant([51, 8]))
    update = lazy_adam.create_hash_optimizer(0.1).apply_gradients([(grad, table.variable)])
    saver = tf.compat.v1.train.Saver()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        table.index.lookup(np.arange(7, dtype=np.int64), allocate=True)
        sess.run(update)
        return saver.save(sess, os.path.join(directory, "model"), global_step=3)


def _inspect(path):
    return subprocess.run([CLI, "inspect", str(path)], capture_output=True, text=True, timeout=60)


def test_inspect_lists_step_world_tables_and_rows(runtime, tmp_path):
    path = _save(tmp_path)
    proc = _inspect(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "model-3: step 3, world size 1, OK" in proc.stdout
    assert "table user_table: dim 8, slots ['LazyAdam.m', 'LazyAdam.v'], rows 7 (rank 0: 7)" in proc.stdout
    assert _inspect(path).stdout == proc.stdout, "a dense prefix names the same checkpoint"


def test_inspect_reports_damage_and_uncommitted_shards(runtime, tmp_path):
    _save(tmp_path)
    shard = tmp_path / "sparse-model-3" / "rank-0-of-1"
    values = shard / "user_table" / "values.npy"
    data = bytearray(values.read_bytes())
    data[-1] ^= 1
    values.write_bytes(bytes(data))
    shutil.copytree(shard, tmp_path / "sparse-model-3" / ".tmp-rank-0-of-1-999")
    proc = _inspect(tmp_path)
    assert proc.returncode == 1
    assert "DAMAGED OR INCOMPLETE" in proc.stdout
    assert f"problem: {values}: checksum mismatch" in proc.stdout
    assert "never committed" in proc.stdout
    (shard / "MANIFEST.json").unlink()
    assert "MANIFEST.json: missing" in _inspect(tmp_path).stdout


def test_inspect_bad_path_exits_2(tmp_path):
    proc = _inspect(tmp_path / "nowhere")
    assert proc.returncode == 2 and "neither a directory nor a checkpoint" in proc.stderr
