"""Table groups (rank_runtime/pipeline/table_groups.py): many tables of mixed dims, placements and
optimizers trained grouped give the same rows bit for bit as ungrouped, and plain TensorFlow's on
the global batches, at 1, 2 and 3 ranks under real mpiexec; a rank that stalls in a grouped step
and a table that one rank lacks stop every rank naming them; the off switch is checked."""
import os
import re
import sys

import numpy as np
import pytest
import tensorflow as tf

from mpi_helpers import JOBS, check, mpiexec

sys.path.insert(0, JOBS)
import group_oracle as job  # noqa: E402

# Two ranks or more: a (row_wise), b, c (table_wise), h (is_grad=False) at dim 4, and d, e, i
# (table_wise) at dim 8; f (replicated) and g (column_wise) each look themselves up; z has no lookup.
GROUPS = ["a,b,c,h", "d,e,i"]


def run(tmp, n, tag, groups, *args, **kwargs):
    return mpiexec(n, "group_oracle.py", tmp, tag, groups, *args, timeout=300, **kwargs)


def parts(tmp, n, tag):
    return [dict(np.load(os.path.join(tmp, f"{tag}-rank{r}-of{n}.npz"))) for r in range(n)]


def held(dumps, table):
    """{key: row} over every rank; replicas equal, column slices joined in rank order."""
    out, slices = {}, {}
    for part in dumps:
        column_wise = str(part[f"{table}.placement"]).startswith("column_wise")
        for key, row in zip(part[f"{table}.keys"].tolist(), part[f"{table}.values"]):
            if column_wise:
                slices.setdefault(key, []).append(row)
            else:
                assert key not in out or np.array_equal(out[key], row), f"{table}: key {key} differs between ranks"
                out[key] = row
    out.update({key: np.concatenate(rows) for key, rows in slices.items()})
    return out


def plain_tensorflow():
    """The job's model on the global batches in one process: a tf.Variable per table, one row per
    key, TensorFlow's gradients (is_grad=False: stopped), SGD by TensorFlow's rule and lazy Adam in
    numpy on the rows a batch touched."""
    data = job.global_data()
    looked_up = [t for t in job.TABLES if t[4] != "unused"]
    keys = {t[0]: np.unique(data[t[0]]) for t in job.TABLES}
    with tf.Graph().as_default():
        tables = {name: tf.compat.v1.Variable(np.full([len(keys[name]), dim], 0.1, np.float32), use_resource=True)
                  for name, dim, *_ in job.TABLES}
        idx = {name: tf.compat.v1.placeholder(tf.int32, [job.GLOBAL_BATCH, job.FIELDS]) for name, *_ in looked_up}
        x = tf.compat.v1.placeholder(tf.float32, [job.GLOBAL_BATCH, job.DENSE])
        y = tf.compat.v1.placeholder(tf.float32, [job.GLOBAL_BATCH])
        embs = [tf.gather(tables[name], idx[name]) for name, *_ in looked_up]
        embs = [e if use == "grad" else tf.stop_gradient(e) for e, (*_, use) in zip(embs, looked_up)]
        loss, w = job.model({"x": x, "y": y}, embs)
        trained = [t for t in job.TABLES if t[4] == "grad"]
        grads = [tf.convert_to_tensor(g) for g in tf.gradients(loss, [tables[t[0]] for t in trained])]
        dense = tf.compat.v1.train.GradientDescentOptimizer(0.05).minimize(loss, var_list=[w])
        moments = {t[0]: (np.zeros([len(keys[t[0]]), t[1]]), np.zeros([len(keys[t[0]]), t[1]])) for t in trained}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step in range(job.STEPS):
                rows = slice(step * job.GLOBAL_BATCH, (step + 1) * job.GLOBAL_BATCH)
                feed = {x: data["x"][rows], y: data["y"][rows]}
                feed.update({idx[name]: np.searchsorted(keys[name], data[name][rows]) for name in idx})
                values = sess.run(grads + [tables[t[0]] for t in trained], feed)
                sess.run(dense, feed)
                for i, (name, _, _, opt, _) in enumerate(trained):
                    g, v = values[i], values[len(trained) + i]
                    touched = np.unique(feed[idx[name]])
                    lr = job.LEARNING_RATES[opt]
                    if opt == "sgd":
                        v[touched] -= lr * g[touched]
                    else:
                        m, s = moments[name]
                        m[touched] = 0.9 * m[touched] + 0.1 * g[touched]
                        s[touched] = 0.999 * s[touched] + 0.001 * g[touched] ** 2
                        n = step + 1
                        v[touched] -= lr * np.sqrt(1 - 0.999**n) / (1 - 0.9**n) * m[touched] / (np.sqrt(s[touched])
                                                                                            + 1e-8)
                    tables[name].load(v, sess)
            final = sess.run(tables)
            return {name: dict(zip(keys[name].tolist(), final[name])) for name in tables}, sess.run(w)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_mixed_tables_train_grouped_as_ungrouped_bit_for_bit_and_as_plain_tensorflow(tmp_path, n):
    for groups in ("on", "off"):
        check(run(tmp_path, n, groups, groups))
    grouped, alone = parts(tmp_path, n, "on"), parts(tmp_path, n, "off")
    for part in grouped:  # one rank has no exchange to save: nothing groups there
        assert part["groups"].tolist() == (GROUPS if n > 1 else [])
    if n > 1:
        # A step's forward row exchanges: one per group and one for g (column-wise) grouped; one per
        # lookup alone (f, replicated, reads its own replica forward).
        assert grouped[0]["alltoalls"][0] == 3 and alone[0]["alltoalls"][0] == 8
        assert grouped[0]["alltoalls"][1] < alone[0]["alltoalls"][1]
    assert all(p["groups"].tolist() == [] for p in alone)
    for on, off in zip(grouped, alone):
        assert int(on["steps"]) == int(off["steps"]) == job.STEPS
        np.testing.assert_array_equal(on["w"], off["w"])
    reference, w = plain_tensorflow()
    for part in grouped:
        np.testing.assert_allclose(part["w"], w, atol=1e-5, rtol=0)
    for name, *_ in job.TABLES:
        rows_on, rows_off = held(grouped, name), held(alone, name)
        assert rows_on.keys() == rows_off.keys() == reference[name].keys(), name
        for key, row in rows_on.items():
            np.testing.assert_array_equal(row, rows_off[key], err_msg=f"{name} key {key}: grouped against alone")
            np.testing.assert_allclose(row, reference[name][key], atol=1e-5, rtol=0, err_msg=f"{name} key {key}")
        moved = max(np.abs(r - 0.1).max() for r in rows_on.values())
        # is_grad=False and no lookup at all: no gradient reaches them, grouped or not.
        assert (moved == 0) == (name in ("h", "z")), (name, moved)


@pytest.mark.parametrize("gradients", ["variables", "by_address"])
def test_dynamic_expansion_groups_train_lookups_as_alone_bit_for_bit(tmp_path, gradients):
    """Dynamic expansion's training lookups read their rows by address (the tensors a by-address
    script takes gradients of): grouped, those rows move in one exchange and learn the same."""
    only = "a,b,c,d,e,h,i"
    for groups in ("on", "off"):
        check(run(tmp_path, 2, groups, groups, "--only", only, "--expansion", gradients))
    grouped, alone = parts(tmp_path, 2, "on"), parts(tmp_path, 2, "off")
    for on, off in zip(grouped, alone):
        assert on["groups"].tolist() == GROUPS and off["groups"].tolist() == []
        assert int(on["steps"]) == int(off["steps"]) == job.STEPS
        np.testing.assert_array_equal(on["w"], off["w"])
    for name in only.split(","):
        on, off = held(grouped, name), held(alone, name)
        assert sorted(on) == sorted(off), name
        for key in on:
            np.testing.assert_array_equal(on[key], off[key], err_msg=f"{name} key {key}")
        moved = any(not np.all(row == np.float32(0.1)) for row in on.values())
        assert moved == (name != "h"), f"{name}: trained {moved}"  # h is looked up with is_grad=False


def test_a_rank_that_stalls_in_a_grouped_step_stops_its_peers_naming_the_group_and_the_rank(tmp_path):
    """Only grouped tables (a, b at dim 4; d, e at dim 8): whichever group's exchange rank 0 reaches
    first names the group's first table and rank 1."""
    proc = run(tmp_path, 2, "stall", "on", "--stall-rank", "1", "--only", "a,b,d,e",
               env={"SHARDREC_EXCHANGE_TIMEOUT_S": "5"})
    assert proc.returncode != 0
    assert "DeadlineExceededError" in proc.stderr
    assert re.search(r"row exchange '(a and 1 more/a|d and 1 more/d)/train#0' \(rank 0 of 2\), rows: rank\(s\) 1 "
                     r"did not send theirs within 5 s", proc.stderr), proc.stderr[-3000:]
    # Which tables each group holds is in rank 0's log of the plan.
    for line in ("group 0: train group of 2 table(s), dim 4, rows in float32: a (a), b (b)",
                 "group 1: train group of 2 table(s), dim 8, rows in float32: d (d), e (e)"):
        assert line in proc.stderr
    assert not os.listdir(tmp_path)


def test_a_table_that_one_rank_lacks_stops_every_rank_in_the_first_key_round_naming_it(tmp_path):
    proc = run(tmp_path, 2, "drop", "on", "--drop-on-last", "e")
    assert proc.returncode != 0
    assert re.search(r"differ at entry 5: rank 0 has feature 'e' \(table 'e', dim 8, .*lookup group 'd'\), rank 1 "
                     r"has feature 'f'", proc.stderr), proc.stderr[-3000:]
    assert not os.listdir(tmp_path)


def test_16_bit_exchanges_in_groups_give_the_values_and_rows_of_tables_alone_bit_for_bit(tmp_path):
    """wire_oracle's tables (float32, bfloat16 and float16 exchanges, row-wise, table-wise and
    replicated) grouped and alone: every looked-up value and every row at the end the same."""
    import wire_oracle as wire_job

    runs = {}
    for groups in ("on", "off"):
        (tmp_path / groups).mkdir()
        check(mpiexec(2, "wire_oracle.py", tmp_path / groups, timeout=300, env={"SHARDREC_TABLE_GROUPS": groups}))
        runs[groups] = [np.load(tmp_path / groups / f"wire-rank{r}.npz") for r in range(2)]
    for on, off in zip(runs["on"], runs["off"]):
        for name in wire_job.TABLES:
            np.testing.assert_array_equal(on[f"{name}.emb"], off[f"{name}.emb"], err_msg=name)
            by_key = [dict(zip(run[f"{name}.keys"].tolist(), run[f"{name}.rows"])) for run in (on, off)]
            assert by_key[0].keys() == by_key[1].keys(), name
            for key, row in by_key[0].items():
                np.testing.assert_array_equal(row, by_key[1][key], err_msg=f"{name} key {key}")


def test_the_off_switch_takes_on_off_1_0_and_names_what_else_it_would_take(monkeypatch):
    from shardrec.rank_runtime.process import lifecycle

    for value, expected in (("on", True), ("OFF", False), ("1", True), ("0", False)):
        monkeypatch.setenv(lifecycle.TABLE_GROUPS_ENV, value)
        assert lifecycle._table_groups(None) is expected
    assert lifecycle._table_groups(False) is False
    monkeypatch.setenv(lifecycle.TABLE_GROUPS_ENV, "maybe")
    with pytest.raises(ValueError, match=r"SHARDREC_TABLE_GROUPS='maybe'; allowed: on, off, 1, 0"):
        lifecycle._table_groups(None)
    with pytest.raises(TypeError, match="table_groups"):
        lifecycle._table_groups("yes")
