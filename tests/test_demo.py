"""The main job, shortened: it trains, evaluates above the AUC bar on its own data, and saves."""
import json
import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The categorical features must add this much AUC over the best dense-only model.
EMBEDDING_MARGIN = 0.10


def dense_only_auc(rank, eval_samples, seed=2024):
    """AUC of the generator's own dense logit on the demo's held-out data of `rank`: no model that
    ignores the embeddings can do better."""
    import criteo_synth

    data = criteo_synth.make_dataset(eval_samples, seed=seed, sample_seed=seed * 31 + 10_000 + rank)
    return criteo_synth.auc(data["label"], criteo_synth.dense_logit(data["dense"], seed))


def test_wide_deep_demo_learns(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "examples", "wide_deep.py"), "--steps", "250",
           "--eval-samples", "20000", "--model-dir", str(tmp_path), "--log-every", "50"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = re.search(r"SUMMARY .*eval_auc=([0-9.]+)", proc.stdout)
    assert summary, proc.stdout
    bar = dense_only_auc(0, 20000) + EMBEDDING_MARGIN
    assert float(summary.group(1)) >= bar, f"AUC {summary.group(1)} < {bar:.3f} (dense-only + margin)"
    line = proc.stdout[summary.start():].splitlines()[0]
    assert "nan" not in line and "row_exchange_share=n/a" in line, line
    assert "[rank 0/1]" in proc.stderr and "samples/s" in proc.stderr
    assert {"model-250.index", "sparse-model-250"} <= set(os.listdir(tmp_path)), os.listdir(tmp_path)


def test_estimator_example_trains_and_evaluates_on_two_ranks(tmp_path):
    from mpi_helpers import check, mpiexec

    proc = check(mpiexec(2, os.path.join(ROOT, "examples", "estimator_wide_deep.py"), "--steps", "120",
                         "--eval-every", "60", "--eval-samples", "4096", "--model-dir", tmp_path, timeout=400))
    summaries = re.findall(r"SUMMARY rank=(\d) global_step=(\d+) eval_auc=([0-9.]+)", proc.stdout)
    assert sorted(r for r, _, _ in summaries) == ["0", "1"], proc.stdout
    for _, step, auc in summaries:
        assert int(step) == 120 and float(auc) >= 0.70
    assert sorted(os.listdir(tmp_path / "sparse-model.ckpt-120")) == ["rank-0-of-2", "rank-1-of-2"]


def test_the_demo_resumes_from_its_checkpoint_as_if_never_stopped(tmp_path):
    """Run 1 stops at step 40 (a checkpoint every 20 steps); run 2, started on the same model
    directory, continues at step 41; both tables, slots included, end bit-equal to one run of 80 steps."""
    from mpi_helpers import check, mpiexec
    from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows

    demo = os.path.join(ROOT, "examples", "wide_deep.py")
    args = ("--batch-size", "128", "--eval-samples", "1024", "--log-every", "20")
    check(mpiexec(2, demo, "--steps", "40", "--save-every", "20", "--model-dir", tmp_path / "resumed", *args))
    second = check(mpiexec(2, demo, "--steps", "80", "--model-dir", tmp_path / "resumed", *args))
    assert f"resumed from {tmp_path / 'resumed' / 'model-40'}: continuing at step 41 of 80" in second.stderr
    assert "SUMMARY rank=0/2 steps=80 resumed_from=40" in second.stdout
    check(mpiexec(2, demo, "--steps", "80", "--model-dir", tmp_path / "once", *args))
    for table in ("deep_table", "wide_table"):
        resumed, once = (table_rows(find_checkpoints(str(tmp_path / d))[-1], table) for d in ("resumed", "once"))
        a, b = np.argsort(resumed["keys"]), np.argsort(once["keys"])
        assert np.array_equal(resumed["keys"][a], once["keys"][b])
        for name in resumed:
            assert np.array_equal(resumed[name][a], once[name][b]), f"{table} {name}"


def test_with_a_global_batch_every_number_of_ranks_reads_the_same_samples_at_each_step():
    """--global-batch-size (an elastic job's input): step s's global batch is the same whether 1 or 2
    ranks read it, split in rank order, from any step on."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import wide_deep

    args = wide_deep.parse_args(["--global-batch-size", "8", "--steps", "120"])
    for start in (0, 37, 60):
        alone = wide_deep.train_samples(args, 0, 1, start)
        pair = [wide_deep.train_samples(args, rank, 2, start) for rank in (0, 1)]
        for name, whole in alone.items():
            steps = 120 - start
            assert len(whole) == steps * 8
            split = np.concatenate([p[name].reshape(steps, 4, *whole.shape[1:]) for p in pair], axis=1)
            np.testing.assert_array_equal(split.reshape(whole.shape), whole, err_msg=name)
    later = wide_deep.train_samples(args, 0, 1, 60)
    np.testing.assert_array_equal(later["label"], wide_deep.train_samples(args, 0, 1, 0)["label"][60 * 8:])


def test_the_stream_demo_trains_every_event_the_producer_wrote_once(tmp_path):
    """`make stream-demo`, shortened: a Redis server, the producer for 12 s (drifting every 4 s),
    the job on 2 ranks under shardrec-run printing its lag; at the end the final checkpoint's stream
    positions hold exactly the events produced, and ids of the first drift were evicted by event
    time. Run from the checkout without --work, as `make stream-demo` does, it leaves the checkout
    as it was (git status) and works in a temporary folder."""
    def status():
        return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], capture_output=True,
                              text=True, cwd=ROOT, check=True).stdout

    before = status()
    cmd = [sys.executable, os.path.join(ROOT, "examples", "stream_wide_deep.py"), "demo", "--seconds", "12",
           "--rate", "800", "--drift-s", "4", "--evict-after", "5", "--evict-every", "4", "--idle", "6", "--incremental", "30,3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, SHARDREC_PROGRESS_S="2", TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert status() == before
    work = re.search(r"\[demo\] its folder \(broker data, events, model, logs\): (\S+)", proc.stdout)
    assert work and os.path.dirname(work[1]) == str(tmp_path) and os.listdir(os.path.join(work[1], "model")), \
        proc.stdout[:2000]
    found = re.search(r"STREAM-DEMO produced=(\d+) trained=(\d+) exit=0 checkpoints_kept=(\d+)", proc.stdout)
    assert found and found[1] == found[2] and int(found[1]) >= 4000, proc.stdout[-3000:]
    assert re.search(r"progress: \d+ samples/s, .*lag partition 0: \d+ records", proc.stdout), proc.stdout[-3000:]
    assert re.search(r"\(a delta on model\.ckpt-\d+\)", proc.stdout), proc.stdout[-3000:]
    evicted = [int(n) for n in re.findall(r"evicted (\d+)", proc.stdout)]
    assert evicted and max(evicted) > 0, proc.stdout[-3000:]


def test_the_stream_demo_serves_the_model_while_it_trains_and_a_new_id_s_prediction_moves(tmp_path):
    """`stream_wide_deep.py demo --serve`, shortened: shardrec-serve follows the 2-rank job from its
    first checkpoint; the client's prediction for an event with the id the producer starts sending
    changes as versions arrive, the last version served is the job's final checkpoint, and the
    prediction of every version the client saw equals a fresh load of shardrec-export on that
    version's checkpoint (abs 1e-6)."""
    import tensorflow as tf

    work = tmp_path / "demo"
    cmd = [sys.executable, os.path.join(ROOT, "examples", "stream_wide_deep.py"), "demo", "--serve", "--seconds", "25",
           "--rate", "800", "--idle", "6", "--incremental", "30,2", "--keep", "1000", "--work", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.search(r"SERVE-DEMO versions=(\d+) last_version=(\d+) final_checkpoint=(\d+) new_id_first=(\S+) "
                      r"new_id_last=(\S+)", proc.stdout)
    assert found and int(found[1]) >= 3 and found[2] == found[3], proc.stdout[-3000:]
    first, last = float(found[4]), float(found[5])
    assert abs(last - first) > 0.01, proc.stdout[-3000:]
    seen = {int(v): float(p) for v, p in re.findall(r"\[client\] +[\d.]+ s: version (\d+) predicts ([\d.]+)",
                                                    proc.stdout)}
    assert len(seen) >= 3, proc.stdout[-3000:]
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import serve_while_training
    import wide_deep
    from shardrec.rank_runtime import export_saved_model

    instance = json.loads(serve_while_training.Client("http://unused", 2024, "unused").body)["instances"][0]
    feeds = {"cat": np.array([instance["cat"]], np.int64), "dense": np.array([instance["dense"]], np.float32)}
    inputs = {"cat": tf.TensorSpec([None, 26], tf.int64), "dense": tf.TensorSpec([None, 13], tf.float32)}
    for version, prob in sorted(seen.items()):
        export = str(tmp_path / f"v{version}")
        export_saved_model(str(work / "model" / f"model.ckpt-{version}"), export, wide_deep.serving_model, inputs)
        with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
            signature = tf.compat.v1.saved_model.load(sess, [tf.saved_model.SERVING], export).signature_def[
                "serving_default"]
            want = sess.run(signature.outputs["prob"].name, {signature.inputs[k].name: v for k, v in feeds.items()})
        assert abs(float(want[0]) - prob) <= 1e-6, (version, float(want[0]), prob)
