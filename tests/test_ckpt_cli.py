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
    from shardrec.rank_runtime import create_table

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
    assert "table user_table: dim 8, slots ['LazyAdam.m', 'LazyAdam.v'], row_wise, rows 7 (rank 0: 7)" in proc.stdout
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


def test_inspect_checks_row_counts_and_the_dense_part(runtime, tmp_path):
    path = _save(tmp_path)
    manifest = tmp_path / "sparse-model-3" / "rank-0-of-1" / "MANIFEST.json"
    text = manifest.read_text()
    manifest.write_text(text.replace('"rows": 7', '"rows": 8'))
    proc = _inspect(tmp_path)
    assert proc.returncode == 1
    assert "keys.npy: holds [7] rows, but the manifest says rows = 8 for table 'user_table'" in proc.stdout
    manifest.write_text(text)
    assert _inspect(tmp_path).returncode == 0
    os.remove(path + ".meta")
    proc = _inspect(tmp_path)
    assert proc.returncode == 1 and f"problem: {path}.meta: missing" in proc.stdout


def test_table_export_in_a_session_gives_this_rank_s_keys_rows_and_slots(runtime, tmp_path):
    from mx_rec.optimizers import lazy_adam
    from shardrec.rank_runtime import create_table

    table = create_table(tf.int64, 2, "t", tf.compat.v1.constant_initializer(0.5), device_vocabulary_size=10)
    grad = tf.IndexedSlices(tf.ones([2, 2]), tf.constant([0, 1], tf.int32), tf.constant([11, 2]))
    update = lazy_adam.create_hash_optimizer(0.1).apply_gradients([(grad, table.variable)])
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        table.index.lookup(np.array([40, -3, 9], np.int64), allocate=True)  # rows 0, 1, 2
        sess.run(update)  # rows 0 and 1 move, row 2 keeps its initial value
        out = table.export(sess)
    assert sorted(out) == ["LazyAdam.m", "LazyAdam.v", "keys", "values"]
    np.testing.assert_array_equal(out["keys"], [40, -3, 9])
    np.testing.assert_allclose(out["values"], [[0.4, 0.4], [0.4, 0.4], [0.5, 0.5]], atol=1e-6)
    np.testing.assert_allclose(out["LazyAdam.m"][:, 0], [0.1, 0.1, 0.0], atol=1e-6)


def test_inspect_bad_path_exits_2(tmp_path):
    proc = _inspect(tmp_path / "nowhere")
    assert proc.returncode == 2 and "neither a directory nor a checkpoint" in proc.stderr
