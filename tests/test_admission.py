"""Feature admission and eviction: exact key sets, counts and timestamps against a plain-Python
model of the stream (admission_oracle.py), on real 2-rank runs (tests/mpi_jobs/admission_train.py),
with a restore between two evictions into 1, 2 and 3 ranks; the held-back rows of an eviction; and
the errors of combinations that cannot work."""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import admission_oracle as oracle
from mpi_helpers import JOBS, check, mpiexec
from pipeline_helpers import batched_iterator, run_all
from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable,
                                   sparse_lookup, start_asc_pipeline)
from shardrec.rank_runtime.process import lifecycle

sys.path.insert(0, JOBS)
import admission_train as job  # noqa: E402

def test_admission_gives_rows_to_exactly_the_keys_seen_threshold_times_globally(tmp_path):
    parts = oracle.run_job(tmp_path, 2, "admit")
    model = oracle.check_against_oracle(parts, "admit", set())
    counts = {}
    for sample in job.stream()[0].reshape(-1).tolist():
        counts[sample] = counts.get(sample, 0) + 1
    assert set(model.rows) == {k for k, c in counts.items() if c >= 3}
    assert set(model.pending) == {k for k, c in counts.items() if c < 3} != set()
    # Evaluation reads the admitted rows and zeros for the rest; the job checked that it counted nothing.
    values = dict(zip(oracle.joined(parts, "keys").tolist(), oracle.joined(parts, "values")))
    for key, row in zip(job.eval_ids().reshape(-1).tolist(), parts[0]["eval_rows"].reshape(-1, job.DIM)):
        np.testing.assert_array_equal(row, values.get(key, np.zeros(job.DIM, np.float32)))
    for part in parts:
        np.testing.assert_array_equal(part["sentinel"], 0.0)
    admitted, rejected = (int(sum(p["counters"][i] for p in parts)) for i in (0, 1))
    assert (admitted, rejected) == (len(model.rows), model.rejected)


@pytest.fixture(scope="module")
def step_eviction(tmp_path_factory):
    out = tmp_path_factory.mktemp("evict_steps")
    return out, oracle.run_job(out, 2, "evict_steps")


def test_eviction_by_step_interval_evicts_exactly_the_old_keys_on_every_rank(step_eviction):
    _, parts = step_eviction
    for part in parts:
        assert set(part["evicted_at"].tolist()) == oracle.STEP_EVICTIONS
    model = oracle.check_against_oracle(parts, "evict_steps", oracle.STEP_EVICTIONS)
    evicted = {k for _, k in model.evicted}
    returned = {k for s, k in model.evicted if any(k in a for a in oracle.run(
        *job.stream(), *job.THRESHOLDS["evict_steps"], oracle.STEP_EVICTIONS)[1][s:])}
    assert {1, 8, 15, 22} & returned, "the stream brings evicted keys back"
    assert int(sum(p["counters"][2] for p in parts)) == len(model.evicted) and evicted
    assert int(sum(p["counters"][3] for p in parts)) > 0, "evicted rows are reused"


def test_eviction_by_time_interval_happens_in_the_same_round_on_every_rank(tmp_path):
    parts = oracle.run_job(tmp_path, 2, "evict_time")
    steps = parts[0]["evicted_at"].tolist()
    assert all(p["evicted_at"].tolist() == steps for p in parts)
    # The interval passes during the sleep after step 20; the first eviction follows it.
    assert steps and min(steps) > job.SLEEP_AFTER, steps
    oracle.check_against_oracle(parts, "evict_time", set(steps))


def test_eviction_with_dynamic_expansion_gives_the_same_exact_sets(tmp_path):
    parts = oracle.run_job(tmp_path, 2, "evict_steps", "--expand")
    oracle.check_against_oracle(parts, "evict_steps", oracle.STEP_EVICTIONS)


@pytest.mark.parametrize("ranks,prefetch", [(1, 1), (2, 1), (3, 1), (2, 6)])
def test_restore_between_two_evictions_into_any_rank_count_changes_nothing(step_eviction, tmp_path, ranks, prefetch):
    """The first run saves at step 20 while its input pipeline has looked batches up beyond it
    (prefetch); the save takes them back, and the resumed run ends exactly as the uninterrupted one."""
    first = tmp_path / "first"
    first.mkdir()
    stopped = oracle.run_job(first, 2, "evict_steps", "--stop-at", 20, "--prefetch", prefetch, tag="first")
    assert all(int(p["looked_up"]) > 20 for p in stopped), "the pipeline had run ahead of the saved step"

    resumed = oracle.run_job(first, ranks, "evict_steps", tag=f"resumed{ranks}")
    assert all(int(p["start"]) == 20 for p in resumed)
    oracle.check_against_oracle(resumed, "evict_steps", oracle.STEP_EVICTIONS)
    _, full = step_eviction
    assert oracle.by_key(resumed, "keys", "counts", "last_seen") == oracle.by_key(full, "keys", "counts", "last_seen")


def test_memory_stays_bounded_on_a_stream_of_new_keys_with_eviction(tmp_path):
    parts = oracle.run_job(tmp_path, 2, "churn")
    for part in parts:
        rss, in_use = part["rss"], part["in_use"]
        assert len(rss) >= 50, len(rss)
        assert rss[49] <= rss[4] * 1.10, (rss[4], rss[49])
        # Rows in use follow the keys alive (a few steps' worth, plus rows held back while the input
        # pipeline runs ahead), not the 900,000 keys a rank has seen.
        assert in_use[49] <= 2 * in_use[4] < job.CHURN_KEYS * job.CHURN_STEPS // 8, (in_use[4], in_use[49])
    admitted = int(sum(p["counters"][0] for p in parts))
    assert admitted == job.CHURN_KEYS * job.CHURN_STEPS


def test_a_checkpoint_takes_back_what_the_index_counted_beyond_its_step():
    """export_as_of(T) against the state the index really had after step T-1, on a random stream
    with admission and evictions (the exchange's order: journal, eviction, lookups)."""
    from shardrec.native import core

    rng = np.random.default_rng(4)
    index = core.EmbeddingIndex("journal", 4096)
    index.set_admission(3, 40)
    seen = {}
    for step in range(30):
        seen[step] = index.export_as_of(2**62)
        index.begin_step(step)
        if step % 7 == 6:
            index.evict(step)
        keys = np.unique(rng.integers(0, 300, size=120)).astype(np.int64)
        ts = np.full(len(keys), 10 * step, np.int64) + rng.integers(0, 5, size=len(keys))
        index.lookup_counted(keys, rng.integers(1, 3, size=len(keys)).astype(np.int64), ts)
        index.newest = int(ts.max())
        if step >= 5:
            index.release_evicted(step - 5)  # training five steps behind the pipeline
    for step in range(25, 30):
        got, want = index.export_as_of(step), seen[step]
        assert got.exact
        for name in ("keys", "rows", "counts", "last_seen"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=f"{name} as of step {step}")
        for name in ("keys", "counts", "last_seen"):
            np.testing.assert_array_equal(getattr(got.pending, name), getattr(want.pending, name),
                                          err_msg=f"pending {name} as of step {step}")
        assert got.newest == want.newest
    assert index.counters().evicted > 0 and index.counters().admitted > 0


def test_evicted_rows_are_held_back_until_training_passed_the_eviction():
    from shardrec.native import core

    index = core.EmbeddingIndex("held", 16)
    index.set_admission(0, 10)
    old = np.array([1, 2, 3], np.int64)
    slots = index.lookup_counted(old, np.ones(3, np.int64), np.array([5, 5, 100], np.int64))
    index.newest = 100
    assert index.evict(7) == 2  # keys 1 and 2: last seen 95 s before the newest
    assert index.held_back() == 2
    assert index.release_evicted(7) == 0  # batches of steps up to 6 may still use them; a save of 7 needs them
    fresh = index.lookup_counted(np.array([4], np.int64), np.ones(1, np.int64), np.array([100], np.int64))
    assert fresh[0] not in slots
    assert index.release_evicted(8) == 2 and index.held_back() == 0
    reused = index.lookup_counted(np.array([5, 6], np.int64), np.ones(2, np.int64), np.array([100, 100], np.int64))
    assert set(reused.tolist()) == set(slots[:2].tolist())
    c = index.counters()
    assert (c.evicted, c.reused, c.admitted) == (2, 2, 6)


def test_counting_keys_wait_for_the_threshold_and_carry_their_newest_timestamp():
    from shardrec.native import core

    index = core.EmbeddingIndex("count", 16)
    index.set_admission(3, -1)
    keys = np.array([10, 11], np.int64)
    first = index.lookup_counted(keys, np.array([2, 1], np.int64), np.array([7, 9], np.int64))
    assert first.tolist() == [index.sentinel] * 2 and index.pending() == 2
    second = index.lookup_counted(keys, np.array([1, 1], np.int64), np.array([4, 12], np.int64))
    assert second[0] != index.sentinel and second[1] == index.sentinel
    assert [a.tolist() for a in index.read_metadata(second[:1])] == [[3], [7]]
    pending = index.export_pending()
    assert [a.tolist() for a in (pending.keys, pending.counts, pending.last_seen)] == [[11], [2], [12]]
    assert index.counters().rejected == 4


def _pending_lists(pending):
    return [a.tolist() for a in (pending.keys, pending.counts, pending.last_seen)]


def _train_rows(access_threshold):
    """A single-rank training run; returns the table's rows by key."""
    lifecycle.init()
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 200, size=(256, 3)).astype(np.int64)
    spec = FeatureSpec("ids", table_name="t", access_threshold=access_threshold)
    iterator, batch = batched_iterator({"ids": ids}, 32, [spec])
    table = create_table(tf.int64, 4, "t", tf.compat.v1.random_uniform_initializer(-1, 1, seed=2),
                         device_vocabulary_size=512)
    emb = sparse_lookup(table, spec, batch=batch)
    from shardrec.rank_runtime.optimizers.lazy_adam import create_hash_optimizer

    _, sparse = get_dense_and_sparse_variable()
    loss = tf.reduce_sum(tf.square(emb - 0.5))
    train = create_hash_optimizer(learning_rate=0.05).apply_gradients(zip(tf.gradients(loss, sparse), sparse))
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        run_all(sess, iterator, train)
        rows = table.export(sess)
    lifecycle.terminate_config_initializer()
    return dict(zip(rows["keys"].tolist(), rows["values"]))


def test_admission_threshold_zero_trains_exactly_as_without_admission():
    with tf.Graph().as_default():
        plain = _train_rows(None)
    with tf.Graph().as_default():
        admitted = _train_rows(0)
    assert plain.keys() == admitted.keys()
    for key, row in plain.items():
        np.testing.assert_array_equal(admitted[key], row)


def _train_with_timestamps(shape):
    """A single-rank run with admission and eviction by step interval, its timestamps shaped `shape`
    ((-1,): [batch]; (-1, 1): [batch, 1]); returns the table's rows, counts, timestamps and pending keys."""
    from mx_rec.core.feature_process import EvictHook
    from shardrec.rank_runtime.optimizers.lazy_adam import create_hash_optimizer

    lifecycle.init()
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 300, size=(512, 3)).astype(np.int64)
    stamps = (1000 + np.arange(512) // 2).astype(np.int64).reshape(shape)  # a second every 2 samples
    spec = FeatureSpec("ids", table_name="t", access_threshold=2, eviction_threshold=60)
    iterator, batch = batched_iterator({"ids": ids, "ts": stamps}, 32, [spec, FeatureSpec("ts", is_timestamp=True)])
    table = create_table(tf.int64, 4, "t", tf.compat.v1.constant_initializer(0.1),
                         device_vocabulary_size=512)
    emb = sparse_lookup(table, spec, batch=batch)
    _, sparse = get_dense_and_sparse_variable()
    loss = tf.reduce_sum(tf.square(emb - 0.5))
    train = tf.group(create_hash_optimizer(learning_rate=0.05).apply_gradients(zip(tf.gradients(loss, sparse), sparse)),
                     tf.compat.v1.train.get_or_create_global_step().assign_add(1))
    start_asc_pipeline()
    hook = EvictHook(evict_step_interval=4, evict_time_interval=None)
    with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as sess:
        sess.run(iterator.initializer)
        while not sess.should_stop():
            try:
                sess.run(train)
            except tf.errors.OutOfRangeError:
                break
        rows = table.export(None)
    keys, slots = table.index.export()
    counts, last_seen = table.index.read_metadata(slots)
    state = {"rows": dict(zip(rows["keys"].tolist(), rows["values"].tolist())),
             "metadata": dict(zip(keys.tolist(), zip(counts.tolist(), last_seen.tolist()))),
             "pending": _pending_lists(table.index.export_pending()), "evicted": table.index.counters().evicted}
    lifecycle.terminate_config_initializer()
    return state


def test_a_timestamp_column_of_batch_by_1_trains_exactly_as_one_of_batch():
    with tf.Graph().as_default():
        flat = _train_with_timestamps((-1,))
    with tf.Graph().as_default():
        column = _train_with_timestamps((-1, 1))
    assert flat["evicted"] > 0 and flat["rows"], "the timestamps decided evictions"
    assert column == flat


def _dataset(**columns):
    return tf.data.Dataset.from_tensor_slices(columns).batch(4)


BAD = [
    ("eviction without a timestamp feature",
     lambda: _dataset(ids=np.zeros((8, 2), np.int64)).map(get_asc_insert_func(
         [FeatureSpec("ids", table_name="t", access_threshold=1, eviction_threshold=5)])),
     ValueError, r"feature 'ids' has eviction_threshold = 5, .* no FeatureSpec\(\.\.\., is_timestamp=True\)"),
    ("two timestamp features",
     lambda: get_asc_insert_func([FeatureSpec("ids", table_name="t"), FeatureSpec("ts", is_timestamp=True),
                                  FeatureSpec("ts2", is_timestamp=True)]),
     ValueError, r"FeatureSpecs 'ts', 'ts2' all have is_timestamp=True"),
    ("a timestamp feature that is not int64",
     lambda: _dataset(ids=np.zeros((8, 2), np.int64), ts=np.zeros(8, np.int32)).map(get_asc_insert_func(
         [FeatureSpec("ids", table_name="t", access_threshold=1, eviction_threshold=5),
          FeatureSpec("ts", is_timestamp=True)])),
     TypeError, r"is_timestamp feature 'ts' is int32 .* must be int64"),
    ("a timestamp feature of samples x 2",
     lambda: _dataset(ids=np.zeros((8, 2), np.int64), ts=np.zeros((8, 2), np.int64)).map(get_asc_insert_func(
         [FeatureSpec("ids", table_name="t"), FeatureSpec("ts", is_timestamp=True)])),
     TypeError, r"is_timestamp feature 'ts' is int64 of shape \(None, 2\); timestamps must be int64 seconds of "
                r"shape \[batch\] or \[batch, 1\]"),
    ("a timestamp feature of samples x 1 x 1",
     lambda: _dataset(ids=np.zeros((8, 2), np.int64), ts=np.zeros((8, 1, 1), np.int64)).map(get_asc_insert_func(
         [FeatureSpec("ids", table_name="t"), FeatureSpec("ts", is_timestamp=True)])),
     TypeError, r"is_timestamp feature 'ts' is int64 of shape \(None, 1, 1\)"),
    ("a timestamp feature with a table", lambda: FeatureSpec("ts", table_name="t", is_timestamp=True),
     ValueError, r"is_timestamp=True .* cannot also take table_name"),
    ("a timestamp feature with thresholds", lambda: FeatureSpec("ts", access_threshold=2, is_timestamp=True),
     ValueError, r"cannot also take access_threshold"),
]


# Thresholds out of [-1, 2^31-1] and eviction without admission: test_bad_input.py's FeatureSpec cases.
@pytest.mark.parametrize("what,build,error,match", BAD, ids=[b[0] for b in BAD])
def test_bad_admission_input_is_refused_when_the_graph_is_built(runtime, what, build, error, match):
    with pytest.raises(error, match=match):
        build()


def _lookups(specs, initializer=None):
    iterator, batch = batched_iterator({"a": np.zeros((8, 2), np.int64), "b": np.zeros((8, 2), np.int64),
                                        "ts": np.zeros(8, np.int64)}, 4, specs + [FeatureSpec("ts", is_timestamp=True)])
    table = create_table(tf.int64, 4, "t", initializer or tf.compat.v1.zeros_initializer(), device_vocabulary_size=64)
    for spec in specs:
        sparse_lookup(table, spec, batch=batch)


def test_two_training_features_with_different_thresholds_for_one_table_name_both(runtime):
    _lookups([FeatureSpec("a", table_name="t", access_threshold=2), FeatureSpec("b", table_name="t")])
    with pytest.raises(ValueError, match=r"table 't': training feature 'a' gives it access_threshold 2, eviction_"
                                         r"threshold -1, but training feature 'b' gives it no admission"):
        start_asc_pipeline()


def test_eviction_on_a_fixed_table_needs_an_initializer_the_native_core_draws(runtime):
    _lookups([FeatureSpec("a", table_name="t", access_threshold=1, eviction_threshold=9)],
             tf.compat.v1.orthogonal_initializer())
    with pytest.raises(ValueError, match=r"table 't': eviction_threshold = 9 \(feature 'a'\) frees rows .* "
                                         r"emb_initializer.*knows these emb_initializers"):
        start_asc_pipeline()


def test_eviction_in_graph_modification_mode_names_the_missing_timestamp_feature(runtime):
    ids = tf.compat.v1.data.make_one_shot_iterator(tf.data.Dataset.from_tensors(np.zeros((4, 2), np.int64))).get_next()
    table = create_table(tf.int64, 4, "t", tf.compat.v1.zeros_initializer(), device_vocabulary_size=64)
    with pytest.raises(ValueError, match=r"access_and_evict_config\['eviction_threshold'\] = 3 .* no timestamp"):
        sparse_lookup(table, ids, modify_graph=True,
                      access_and_evict_config={"access_threshold": 1, "eviction_threshold": 3})


def test_negative_timestamps_stop_the_run_naming_the_feature(runtime):
    spec = FeatureSpec("ids", table_name="t", access_threshold=1, eviction_threshold=5)
    iterator, batch = batched_iterator({"ids": np.zeros((8, 2), np.int64), "ts": np.array([3, -4] * 4, np.int64)}, 4,
                                       [spec, FeatureSpec("ts", is_timestamp=True)])
    table = create_table(tf.int64, 4, "t", tf.compat.v1.zeros_initializer(), device_vocabulary_size=64)
    emb = sparse_lookup(table, spec, batch=batch)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        with pytest.raises(tf.errors.OpError, match=r"rank 0 has timestamp -4 in is_timestamp feature 'ts'; "
                                                    r"timestamps must be seconds >= 0"):
            run_all(sess, iterator, emb)
    assert table.size() == 0


def test_evict_hook_parameters(runtime):
    from mx_rec.core.feature_process import EvictHook

    with pytest.raises(ValueError, match=r"'evict_step_interval' = 0 .*\[1, 2147483647\]"):
        EvictHook(evict_step_interval=0)
    with pytest.raises(ValueError, match="both None"):
        EvictHook(evict_time_interval=None)
    with pytest.raises(TypeError, match="'evict_enable' must be a bool"):
        EvictHook(evict_enable="yes")
    EvictHook(evict_enable=False, evict_time_interval=None)


def _small_graph(access, ids):
    lifecycle.init()
    spec = FeatureSpec("ids", table_name="t", access_threshold=access)
    iterator, batch = batched_iterator({"ids": ids}, 4, [spec])
    table = create_table(tf.int64, 4, "t", tf.compat.v1.ones_initializer(), device_vocabulary_size=64)
    emb = sparse_lookup(table, spec, batch=batch)
    tf.compat.v1.train.get_or_create_global_step()
    start_asc_pipeline()
    return iterator, table, emb


def _saved(tmp_path, access, ids):
    """Runs `ids` through a lookup of a table with access_threshold `access` and saves; returns
    (checkpoint path, the index's state)."""
    from shardrec.rank_runtime.checkpoint.saver import Saver

    with tf.Graph().as_default():
        iterator, table, emb = _small_graph(access, ids)
        saver = Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            run_all(sess, iterator, emb)
            path = saver.save(sess, str(tmp_path / "m"), global_step=1)
            state = table.index.export_as_of(2**62) if access is not None else None
        lifecycle.terminate_config_initializer()
    return path, state


def test_restored_checkpoint_without_counts_admits_its_keys(tmp_path):
    """A checkpoint saved before admission was on: its keys come back admitted, count 0."""
    from shardrec.rank_runtime.checkpoint.saver import Saver

    ids = np.arange(16, dtype=np.int64).reshape(8, 2)
    path, _ = _saved(tmp_path, None, ids)
    with tf.Graph().as_default():
        iterator, table, emb = _small_graph(5, ids)
        saver = Saver()
        with tf.compat.v1.Session() as sess:
            saver.restore(sess, path)
            keys, rows = table.index.export()
            assert sorted(keys.tolist()) == list(range(16))
            assert [a.tolist() for a in table.index.read_metadata(rows)] == [[0] * 16, [0] * 16]
            # Restored keys read their rows at once, though their count is below the threshold.
            out = run_all(sess, iterator, emb)
            np.testing.assert_array_equal(np.concatenate(out), 1.0)
        lifecycle.terminate_config_initializer()


def test_a_damaged_admission_entry_is_refused_with_the_manifest_named(tmp_path):
    import json

    from shardrec.rank_runtime.formats import sparse_checkpoint as fmt
    from shardrec.rank_runtime.checkpoint.saver import Saver

    ids = np.array([[1, 1], [1, 2], [2, 3], [4, 1]], np.int64)
    path, _ = _saved(tmp_path, 3, ids)
    manifest = os.path.join(fmt.sparse_dir(path), fmt.shard_name(0, 1), fmt.MANIFEST)
    with open(manifest) as f:
        content = json.load(f)
    del content["tables"]["t"]["files"]["pending_counts"]
    with open(manifest, "w") as f:
        json.dump(content, f)
    with tf.Graph().as_default():
        _small_graph(3, ids)
        saver = Saver()
        with tf.compat.v1.Session() as sess:
            with pytest.raises(fmt.CheckpointError, match=r"MANIFEST.json: table 't' has a damaged admission entry"):
                saver.restore(sess, path)
        lifecycle.terminate_config_initializer()


def test_warm_start_brings_counts_timestamps_and_counting_keys_along(tmp_path):
    from shardrec.rank_runtime.formats import sparse_checkpoint as fmt
    from shardrec.rank_runtime.checkpoint.warm_start import warm_start

    ids = np.array([[1, 1], [1, 2], [2, 3], [4, 1], [5, 5], [5, 6], [7, 8], [2, 9]], np.int64)
    path, saved = _saved(tmp_path, 3, ids)
    assert len(saved.keys) and len(saved.pending.keys)
    with tf.Graph().as_default():
        _, table, _ = _small_graph(3, ids)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            warm_start(sess, tf.estimator.WarmStartSettings(ckpt_to_initialize_from=path, vars_to_warm_start=".*"))
            got = table.index.export_as_of(2**62)
        lifecycle.terminate_config_initializer()
    want, got = {"keys": saved.keys, **fmt.admission_arrays(saved)}, {"keys": got.keys, **fmt.admission_arrays(got)}
    for name in ("keys", "counts", "last_seen", "pending_keys", "pending_counts", "pending_last_seen"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_eviction_in_estimator_mode_checkpoints_the_exact_sets(tmp_path):
    """Two Estimator.train calls (the second resumes from the first's checkpoint at step 20): the
    final checkpoint holds exactly the oracle's keys, counts, timestamps and pending keys."""
    import os

    from shardrec.rank_runtime.formats import sparse_checkpoint as fmt
    from shardrec.rank_runtime.formats.array_files import read_array

    check(mpiexec(2, "admission_estimator.py", tmp_path / "model", timeout=600))
    latest = tf.train.latest_checkpoint(str(tmp_path / "model"))
    assert latest.endswith(f"-{job.STEPS}")
    parts = []
    for r in range(2):
        shard = os.path.join(fmt.sparse_dir(latest), fmt.shard_name(r, 2))
        entry = fmt.read_manifest(shard).tables["emb"]
        parts.append({name: read_array(shard, item, name) for name, item in entry.files.items()})
    model, _, _ = oracle.run(*job.stream(), *job.THRESHOLDS["evict_steps"], oracle.STEP_EVICTIONS)
    assert oracle.by_key(parts, "keys", "counts", "last_seen") == {k: tuple(v) for k, v in model.rows.items()}
    assert oracle.by_key(parts, "pending_keys", "pending_counts", "pending_last_seen") == {
        k: tuple(v) for k, v in model.pending.items()}
    assert model.evicted
    _served_rows_are_the_admitted_keys_rows(latest, parts, model, tmp_path)


def _served_rows_are_the_admitted_keys_rows(checkpoint, parts, model, tmp_path):
    """The checkpoint exported (a FeatureSpec lookup, a serving default) and served without shardrec:
    an admitted key reads its row, a pending, evicted or never seen key the default."""
    import admission_estimator
    from serving_helpers import serve

    from shardrec.rank_runtime.serving.export import export_saved_model

    default = -3.0  # neither a trained row's value nor the initial 0.25

    def outputs(features):
        table = create_table(key_dtype=tf.int64, dim=job.DIM, name="emb",
                             emb_initializer=tf.compat.v1.constant_initializer(job.INIT), device_vocabulary_size=4096)
        return {"emb": sparse_lookup(table, admission_estimator.spec(), batch=features, serving_default_value=default)}

    export_saved_model(checkpoint, str(tmp_path / "export"), outputs, {"ids": tf.TensorSpec([None], tf.int64)})
    rows = {int(k): v for p in parts for k, v in zip(p["keys"], p["values"])}
    evicted = {key for _, key in model.evicted}
    absent = sorted((set(model.pending) | evicted) - set(rows)) + [2**40 + 7]
    ids = np.array(sorted(rows) + absent, np.int64)
    emb = serve(tmp_path / "export", {"ids": ids}, tmp_path)["emb"]
    np.testing.assert_array_equal(emb[:len(rows)], np.stack([rows[k] for k in sorted(rows)]))
    np.testing.assert_array_equal(emb[len(rows):], np.full((len(absent), job.DIM), default, np.float32))
    assert set(model.pending) - set(rows) and evicted - set(rows), "the test has keys of both kinds"
