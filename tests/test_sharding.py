"""Placements (row-wise, table-wise, replicated, column-wise) under real mpiexec against plain
TensorFlow on the global batches; a checkpoint saved under one plan restored exactly under another
plan and rank count; the plan in shardrec-ckpt inspect."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from mpi_helpers import JOBS, check, mpiexec

sys.path.insert(0, JOBS)
import placement_oracle as job  # noqa: E402

pytestmark = pytest.mark.quick

ALL_ROW_WISE = "a=row_wise,b=row_wise,c=row_wise"


def run(tmp, n, tag, *args, opts=("sgd",), modes=("plain",)):
    """{(optimizer, mode): every rank's dump} of one job that trains each in turn; a single pair's
    dump alone when one of each is asked for."""
    check(mpiexec(n, "placement_oracle.py", tmp, tag, "--opt", ",".join(opts), "--modes", ",".join(modes), *args,
                  timeout=300))
    out = {(o, m): [dict(np.load(os.path.join(tmp, f"{tag}-{o}-{m}-rank{r}-of{n}.npz"))) for r in range(n)]
           for o in opts for m in modes}
    return out[opts[0], modes[0]] if len(out) == 1 else out


def held(parts, table, column="values"):
    """{key: row of `column`} over every rank; a replicated table's rows must be the same on every
    rank; a column-wise table's slices (each slice rank's export: its columns) are joined in rank order."""
    out, slices = {}, {}
    for part in parts:
        placement = str(part[f"{table}.placement"])
        for key, row in zip(part[f"{table}.keys"].tolist(), part[f"{table}.{column}"]):
            if placement.startswith("column_wise"):
                slices.setdefault(key, []).append(row)
                continue
            if key in out:
                assert placement == "replicated", f"{table}: key {key} on two ranks"
                np.testing.assert_array_equal(out[key], row, err_msg=f"{table}: replicas of key {key} differ")
            out[key] = row
    for key, rows in slices.items():
        assert key not in out and sum(len(r) for r in rows) == job.DIM, f"{table}: key {key}'s slices {rows}"
        out[key] = np.concatenate(rows)
    return out


def plain_tensorflow(opt):
    """The job's model on the global batches in one process: a dense tf.Variable per table, one row
    per key, TensorFlow's gradients; SGD by TensorFlow, lazy Adam in numpy (only touched rows and
    their moments move)."""
    data = job.global_data()
    keys = {t: np.unique(data[t]) for t in job.TABLES}
    lr = job.LEARNING_RATES[opt]
    with tf.Graph().as_default():
        tables = [tf.compat.v1.Variable(np.full([len(keys[t]), job.DIM], 0.1, np.float32), use_resource=True)
                  for t in job.TABLES]
        idx = [tf.compat.v1.placeholder(tf.int32, [job.GLOBAL_BATCH, job.FIELDS]) for _ in job.TABLES]
        x = tf.compat.v1.placeholder(tf.float32, [job.GLOBAL_BATCH, job.DENSE])
        y = tf.compat.v1.placeholder(tf.float32, [job.GLOBAL_BATCH])
        loss, w = job.model({"x": x, "y": y}, None, None, embs=[tf.gather(v, i) for v, i in zip(tables, idx)])
        grads = tf.gradients(loss, tables)
        dense = tf.compat.v1.train.GradientDescentOptimizer(0.05).minimize(loss, var_list=[w])
        sparse = tf.compat.v1.train.GradientDescentOptimizer(lr).apply_gradients(zip(grads, tables))
        dense_grads = [tf.convert_to_tensor(g) for g in grads]
        moments = {t: (np.zeros([len(keys[t]), job.DIM]), np.zeros([len(keys[t]), job.DIM])) for t in job.TABLES}
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step in range(job.STEPS):
                rows = slice(step * job.GLOBAL_BATCH, (step + 1) * job.GLOBAL_BATCH)
                feed = {x: data["x"][rows], y: data["y"][rows]}
                feed.update({i: np.searchsorted(keys[t], data[t][rows]) for i, t in zip(idx, job.TABLES)})
                if opt == "sgd":
                    sess.run([dense, sparse], feed)
                    continue
                values = sess.run(dense_grads + tables, feed)
                sess.run(dense, feed)
                for i, t in enumerate(job.TABLES):
                    g, v = values[i], values[len(job.TABLES) + i]
                    touched = np.unique(feed[idx[i]])
                    m, s = moments[t]
                    m[touched] = 0.9 * m[touched] + 0.1 * g[touched]
                    s[touched] = 0.999 * s[touched] + 0.001 * g[touched] ** 2
                    n = step + 1
                    v[touched] -= lr * np.sqrt(1 - 0.999**n) / (1 - 0.9**n) * m[touched] / (np.sqrt(s[touched]) + 1e-8)
                    tables[i].load(v, sess)
            return {t: dict(zip(keys[t].tolist(), v)) for t, v in zip(job.TABLES, sess.run(tables))}, sess.run(w)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_placement_trains_as_plain_tensorflow(tmp_path, n):
    """Dynamic shapes, and static ones (send_count: every block padded, so a column-wise table's
    slices come back at padded offsets)."""
    runs = run(tmp_path, n, "t", opts=("sgd", "lazy_adam"), modes=("plain", "static"))
    for opt in ("sgd", "lazy_adam"):
        for mode in ("plain", "static"):
            check_against_plain_tensorflow(runs[opt, mode], n, opt)


def check_against_plain_tensorflow(parts, n, opt):
    reference, w = plain_tensorflow(opt)
    for part in parts:
        assert int(part["steps"]) == job.STEPS
        np.testing.assert_allclose(part["w"], w, atol=1e-5, rtol=0)
    for table in job.TABLES:
        rows = held(parts, table)
        assert rows.keys() == reference[table].keys(), table
        # global_size() counts each key once: a replica's or a column slice's copies are not more keys.
        assert [int(p[f"{table}.global_size"]) for p in parts] == [len(rows)] * n, table
        assert max(np.abs(r - 0.1).max() for r in rows.values()) > 0.01, "training moved the rows"
        for key, row in reference[table].items():
            np.testing.assert_allclose(rows[key], row, atol=1e-5, rtol=0, err_msg=f"{table} key {key}")
    # Where each table's keys live: b on the last rank alone, c on every rank, a by key mod n, d's
    # every key on each of the last two ranks (on one rank: that one), with half of each row there.
    slices = min(n, 2)
    for rank, part in enumerate(parts):
        assert (len(part["b.keys"]) > 0) == (rank == n - 1)
        assert sorted(part["c.keys"].tolist()) == sorted(reference["c"])
        assert all(k % n == rank for k in part["a.keys"].tolist())
        on_slice = rank >= n - slices
        assert sorted(part["d.keys"].tolist()) == (sorted(reference["d"]) if on_slice else [])
        assert part["d.values"].shape[1:] == (job.DIM // slices,)


def test_the_planners_plan_is_printed_keeps_a_group_together_and_trains_as_plain_tensorflow(tmp_path):
    """init(sharding_plan="auto") on 2 ranks: table a table-wise on the rank the planner finds least
    loaded, b in a's sharding group (so on a's rank, where alone the planner replicates it), c left
    to the planner (replicated, as these small tables are), d column-wise on the ranks the planner
    picks (both: dim 4 in two slices): rank 0 prints the plan with who chose each placement and the
    group, and the model still follows plain TensorFlow."""
    proc = check(mpiexec(2, "placement_oracle.py", tmp_path, "auto", "--sharding", "a=table_wise,d=column_wise",
                         "--plan", "auto", "--groups", "a=g,b=g", timeout=240))
    plan = proc.stderr[proc.stderr.index("sharding plan for 2 rank(s), 4 table(s)"):]
    for table, placement, ranks, by, group in (("a", "table_wise on rank 0", "0", "user", "g"),
                                               ("b", "table_wise on rank 0", "0", "group", "g"),
                                               ("c", "replicated", "0,1", "planner", "-"),
                                               ("d", "column_wise on ranks 0,1", "0,1", "user", "-")):
        assert re.search(rf"\n{table} +{placement} +{ranks} +120 +4 +18 .* {by} +{group}\n", plan), plan[:2000]
    assert "imbalance (most loaded rank's estimate / mean)" in plan
    parts = [dict(np.load(os.path.join(tmp_path, f"auto-sgd-plain-rank{r}-of2.npz"))) for r in range(2)]
    assert [str(p["b.placement"]) for p in parts] == ["table_wise on rank 0"] * 2
    assert len(parts[1]["a.keys"]) == len(parts[1]["b.keys"]) == 0 < len(parts[0]["b.keys"])
    reference, _ = plain_tensorflow("sgd")
    for table in job.TABLES:
        rows = held(parts, table)
        assert rows.keys() == reference[table].keys(), table
        for key, row in reference[table].items():
            np.testing.assert_allclose(rows[key], row, atol=1e-5, rtol=0, err_msg=f"{table} key {key}")


def test_ranks_that_place_a_table_differently_stop_at_the_first_batch_naming_it(tmp_path):
    """The last rank replicates table c where the others spread it: every rank stops in the first
    key round with the difference named, none trains on a table its peers hold otherwise."""
    proc = mpiexec(2, "placement_oracle.py", tmp_path, "differ", "--sharding", ALL_ROW_WISE,
                   "--last-rank-sharding", "a=row_wise,b=row_wise,c=replicated", timeout=240)
    assert proc.returncode != 0
    assert re.search(r"key exchange 'train' differ at entry 3: rank 0 has feature 'c' \(table 'c', .*row_wise, lookup "
                     r"group 'a'\), rank 1 has feature 'c' \(table 'c', .*replicated\)", proc.stderr), proc.stderr[-3000:]
    assert not os.listdir(tmp_path)


def test_ranks_that_disagree_on_a_table_s_exchange_dtype_stop_at_the_first_batch_naming_it(tmp_path):
    """The last rank exchanges its tables' rows in bfloat16, the other in float32: both stop in the
    first key round with the difference named, before a row crosses."""
    proc = mpiexec(2, "placement_oracle.py", tmp_path, "wire", "--sharding", ALL_ROW_WISE,
                   "--last-rank-exchange-dtype", "bfloat16", timeout=240)
    assert proc.returncode != 0
    assert re.search(r"differ at entry 1: rank 0 has feature 'a' \(table 'a', [^)]*, row_wise, lookup group 'a'\), "
                     r"rank 1 has feature 'a' \(table 'a', [^)]*, rows exchanged in bfloat16, row_wise, "
                     r"lookup group 'a'\)", proc.stderr), \
        proc.stderr[-3000:]
    assert not os.listdir(tmp_path)


def test_replicas_of_16_bit_rows_round_alike(tmp_path):
    """bfloat16 values with stochastic rounding: every replica draws the same roundings (the rows
    stay bitwise equal across ranks, held() checks) and the model still follows plain TensorFlow."""
    parts = run(tmp_path, 2, "bf16", "--value-dtype", "bfloat16")
    reference, _ = plain_tensorflow("sgd")
    for table in job.TABLES:
        rows = held(parts, table)
        assert rows.keys() == reference[table].keys()
        for key, row in reference[table].items():
            np.testing.assert_allclose(rows[key], row, atol=2e-2, rtol=0, err_msg=f"{table} key {key}")


def _rounded(x, wire):
    """x rounded to the nearest `wire` value, ties to even, back in float32 (numpy's own float16
    cast; bfloat16 by its bits)."""
    x = np.asarray(x, np.float32)
    if wire == "float16":
        return x.astype(np.float16).astype(np.float32)
    if wire == "bfloat16":
        bits = x.view(np.uint32).astype(np.uint64)
        return ((((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).astype(np.uint32)).view(np.float32)
    return x


def test_rows_and_gradients_cross_in_the_exchange_dtype(tmp_path):
    """create_table(exchange_dtype=): on 2 ranks every looked-up value is the owner's row rounded to
    the wire dtype (a replicated table's rows do not travel: not rounded), every requester's row
    gradient is rounded once before the owner sums them, and SGD's rows match a numpy reference
    bitwise; a 16-bit table's exchanges send half the float32 table's bytes (tables alone: own bytes)."""
    import wire_oracle as wire_job

    check(mpiexec(2, "wire_oracle.py", tmp_path, timeout=300, env={"SHARDREC_TABLE_GROUPS": "off"}))
    got = [np.load(tmp_path / f"wire-rank{r}.npz") for r in range(2)]
    for name, (wire, sharding, _) in wire_job.TABLES.items():
        rows = {}
        for step in range(wire_job.STEPS):
            part = slice(step * wire_job.BATCH, (step + 1) * wire_job.BATCH)
            summed = {}
            for r in range(2):
                ids, c = got[r]["ids"][part, 0], got[r]["c"][part]
                before = np.stack([rows.get(k, np.full(wire_job.DIM, 0.3, np.float32)) for k in ids])
                want = before if sharding == "replicated" else _rounded(before, wire)
                np.testing.assert_array_equal(got[r][f"{name}.emb"][step], want, err_msg=f"{name} step {step} rank {r}")
                for k in np.unique(ids):
                    g = _rounded(c[ids == k].sum(axis=0, dtype=np.float32), wire)
                    summed[k] = summed[k] + g if k in summed else g
            for k, g in summed.items():
                rows[k] = rows.get(k, np.full(wire_job.DIM, 0.3, np.float32)) - np.float32(wire_job.LEARNING_RATE) * g
        holders = range(2) if sharding == "replicated" else [r for r in range(2) if len(got[r][f"{name}.keys"])]
        for r in holders:
            for k, row in zip(got[r][f"{name}.keys"], got[r][f"{name}.rows"]):
                np.testing.assert_array_equal(row, rows[k], err_msg=f"{name} key {k} on rank {r}")
        copies = 2 if sharding == "replicated" else 1
        assert sorted(k for r in holders for k in got[r][f"{name}.keys"]) == sorted(list(rows) * copies), name
    for r in range(2):
        assert got[r]["f32.bytes"] > 0
        assert got[r]["b16.bytes"] * 2 == got[r]["h16.bytes"] * 2 == got[r]["f32.bytes"], r
    # Pooled on the owners (key mod 2): each owner's partial sum of an example is rounded on its way
    # and so is its gradient coming back; the weights cross as they are.
    rows = {}
    for step in range(wire_job.STEPS):
        summed = {}
        for r in range(2):
            splits, pooled, weights = got[r]["splits"], got[r]["pooled"], got[r]["weights"]
            c = got[r]["c"]
            for e in range(step * wire_job.BATCH, (step + 1) * wire_job.BATCH):
                ids, w = pooled[splits[e]:splits[e + 1]], weights[splits[e]:splits[e + 1]]
                want = np.zeros(wire_job.DIM, np.float32)
                for owner in range(2):
                    mine = ids % 2 == owner
                    if mine.any():
                        partial = sum(w[i] * rows.get(k, np.full(wire_job.DIM, 0.25, np.float32))
                                      for i, k in enumerate(ids) if mine[i])
                        want = want + _rounded(partial, "bfloat16")
                np.testing.assert_array_equal(got[r]["pool.emb"][step][e - step * wire_job.BATCH], want,
                                              err_msg=f"pool step {step} rank {r} example {e}")
                for owner in range(2):
                    back = _rounded(c[e], "bfloat16")
                    for i, k in enumerate(ids):
                        if k % 2 == owner:
                            summed[k] = summed.get(k, np.zeros(wire_job.DIM, np.float32)) + w[i] * back
        for k, g in summed.items():
            rows[k] = rows.get(k, np.full(wire_job.DIM, 0.25, np.float32)) - np.float32(wire_job.LEARNING_RATE) * g
    for r in range(2):
        for k, row in zip(got[r]["pool.keys"], got[r]["pool.rows"]):
            assert k % 2 == r
            np.testing.assert_array_equal(row, rows[k], err_msg=f"pool key {k}")
    assert sorted(k for r in range(2) for k in got[r]["pool.keys"]) == sorted(rows)
    pooled_wires = {tuple(w.split()[1:]) for w in got[0]["wires"] if w.startswith("pool")}
    assert pooled_wires == {("float32", "1"), ("bfloat16", "4")}, got[0]["wires"]


def test_placements_with_admission_and_expansion_match_one_rank_row_wise(tmp_path):
    modes = ("admission", "expansion")
    one = run(tmp_path, 1, "ref", "--sharding", ALL_ROW_WISE, opts=("lazy_adam",), modes=modes)
    for n in (2, 3):
        placed = run(tmp_path, n, f"placed{n}", opts=("lazy_adam",), modes=modes)
        for mode in modes:
            for table in job.TABLES:
                expected, rows = held(one["lazy_adam", mode], table), held(placed["lazy_adam", mode], table)
                assert rows.keys() == expected.keys(), (n, mode, table)
                for key, row in expected.items():
                    np.testing.assert_allclose(rows[key], row, atol=1e-5, rtol=0,
                                               err_msg=f"{n} ranks, {mode}: {table} key {key}")


def test_saved_under_a_plan_restores_exactly_under_other_plans_and_rank_counts(tmp_path):
    """Saved on 2 ranks with a table of each placement (the column-wise one's slices joined into
    whole rows); restored all row-wise on 3 ranks and on 1, with the placements swapped on 2, and
    column-wise on 3 (slices taken from whole rows): every table's rows (values and lazy Adam's
    slots) exact; shardrec-ckpt inspect shows the plan the save was made under."""
    prefix = tmp_path / "ckpt" / "model"
    saved = run(tmp_path, 2, "saved", "--save", prefix, opts=("lazy_adam",))
    path = f"{prefix}-{job.STEPS}"
    for n, sharding in ((3, ALL_ROW_WISE + ",d=row_wise"), (1, ALL_ROW_WISE + ",d=row_wise"),
                        (2, "a=replicated,b=row_wise,c=table_wise:0,d=table_wise:1"),
                        (3, "a=column_wise:1-2,b=column_wise:0-1,c=replicated,d=column_wise:1-2")):
        parts = run(tmp_path, n, f"restored{n}", "--sharding", sharding, "--restore", path, opts=("lazy_adam",))
        for table in job.TABLES:
            for column in ("values", "LazyAdam.m", "LazyAdam.v"):
                expected, rows = held(saved, table, column), held(parts, table, column)
                assert rows.keys() == expected.keys(), (n, table)
                for key, row in expected.items():
                    np.testing.assert_array_equal(rows[key], row, err_msg=f"{n} ranks {table}.{column} key {key}")
    cli = subprocess.run([os.path.join(os.path.dirname(sys.executable), "shardrec-ckpt"), "inspect",
                          str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert "table b: dim 4, slots ['LazyAdam.m', 'LazyAdam.v'], table_wise on rank 1, rows" in cli.stdout, cli.stdout
    assert "table c: dim 4, slots ['LazyAdam.m', 'LazyAdam.v'], replicated, rows" in cli.stdout
    assert "table d: dim 4, slots ['LazyAdam.m', 'LazyAdam.v'], column_wise on ranks 0,1, rows" in cli.stdout
    assert "the sharding plan it was saved under:" in cli.stdout and "imbalance" in cli.stdout


# ---- bad input, the planner, on one rank in this process

from shardrec.rank_runtime import CostModel, ShardingPlan, TableShape, plan_sharding  # noqa: E402
from shardrec.rank_runtime import create_table, get_asc_insert_func, start_asc_pipeline  # noqa: E402
from shardrec.rank_runtime.formats.sharding_plan import PlanError  # noqa: E402
from shardrec.rank_runtime.process import lifecycle  # noqa: E402

# Criteo Kaggle's 26 categorical cardinalities, as the DLRM papers and TorchRec's examples cite them.
CRITEO = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306, 10,
          5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def make_table(name="t", **over):
    kw = dict(key_dtype=tf.int64, dim=4, name=name, emb_initializer=tf.compat.v1.zeros_initializer(),
              device_vocabulary_size=10)
    kw.update(over)
    return create_table(**kw)


@pytest.mark.parametrize("over,pattern", [
    ({"sharding": "diagonal"}, r"table 't': unknown sharding 'diagonal'; allowed: 'row_wise', 'table_wise', "
                               r"'replicated', 'column_wise'"),
    ({"sharding": "column_wise", "sharding_rank": [0, 1]}, r"table 't': column-wise ranks \[0, 1\]; allowed: a list "
                                                           r"of consecutive ranks in \[0, 0\]"),
    ({"sharding": "column_wise", "sharding_rank": 0}, r"column-wise ranks 0; allowed: a list of consecutive ranks"),
    ({"sharding": "column_wise", "sharding_rank": []}, r"column-wise ranks \[\]; allowed: a list of consecutive"),
    ({"sharding": "column_wise", "sharding_rank": [0], "host_vocabulary_size": 10, "ssd_vocabulary_size": 10},
     r"table 't': a column-wise table has no SSD tier"),
    ({"sharding": "table_wise", "sharding_rank": 1}, r"table 't': table-wise rank 1 is outside the world of 1 "
                                                     r"ranks; allowed: an int in \[0, 0\]"),
    ({"sharding": "table_wise", "sharding_rank": -1}, r"table-wise rank -1 is outside the world"),
    ({"sharding": "replicated", "sharding_rank": 0}, r"a rank \(0\) is given for sharding='replicated'"),
    ({"sharding_rank": 0}, r"sharding_rank=0 places a table-wise table .*; give sharding='table_wise' "
                           r"\(or 'column_wise'\)"),
    ({"sharding": "replicated", "host_vocabulary_size": 10, "ssd_vocabulary_size": 10},
     r"table 't': a replicated table has no SSD tier"),
    ({"sharding": "replicated", "emb_initializer": tf.compat.v1.glorot_uniform_initializer()},
     r"for a replicated table .* knows these emb_initializers"),
])
def test_a_bad_placement_is_refused_naming_the_table(runtime, over, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_table(**over)
        # The initializer is drawn when the variable's initial value is built: at create_table.


def write_plan(path, tables):
    path.write_text(__import__("json").dumps({"world_size": 1, "tables": tables}))
    return str(path)


def test_a_plan_file_must_name_exactly_the_jobs_tables(graph, tmp_path):
    lifecycle.init(sharding_plan=write_plan(tmp_path / "p.json", {"t": {"sharding": "replicated"},
                                                                  "ghost": {"sharding": "row_wise"}}))
    table = make_table()
    assert table.placement.describe() == "replicated"
    with pytest.raises(ValueError, match=r"table 'u': the sharding plan does not place it; it places \['ghost', 't'\]"):
        make_table("u")
    spec = __import__("pipeline_helpers").FeatureSpec("f", table_name="t")
    dataset = tf.data.Dataset.from_tensor_slices({"f": np.zeros([4, 1], np.int64)}).batch(2)
    dataset.map(get_asc_insert_func([spec], is_training=True))
    with pytest.raises(ValueError, match=r"the sharding plan names table\(s\) \['ghost'\] that the job does not "
                                         r"create; the job's tables: \['t'\]"):
        start_asc_pipeline()


@pytest.mark.parametrize("plan,pattern", [
    ({"t": {"sharding": "table_wise", "rank": 3}}, r"p.json.*|table 't': table-wise rank 3 is outside the world of 1"),
    ({"t": {"placement": "row_wise"}}, r"p.json: table 't' has no 'sharding'"),
    ({"t": {"sharding": "sideways"}}, r"table 't': unknown sharding 'sideways'"),
    ({"t": {"sharding": "column_wise", "ranks": [0, 1]}}, r"table 't': column-wise ranks \[0, 1\]; allowed: a list of "
                                                          r"consecutive ranks in \[0, 0\]"),
    ({"t": {"sharding": "column_wise", "rank": 0}}, r"p.json: table 't' is column_wise with no 'ranks'"),
])
def test_a_damaged_plan_file_is_refused_at_init(graph, tmp_path, plan, pattern):
    with pytest.raises(ValueError, match=pattern):
        lifecycle.init(sharding_plan=write_plan(tmp_path / "p.json", plan))


def test_a_plan_file_that_is_missing_or_not_json_is_refused(graph, tmp_path):
    with pytest.raises(ValueError, match=r"sharding plan '.*nope.json' does not exist"):
        lifecycle.init(sharding_plan=str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"bad.json' cannot be read as JSON"):
        lifecycle.init(sharding_plan=str(tmp_path / "bad.json"))


def test_the_planner_replicates_small_tables_spreads_large_ones_and_is_deterministic():
    shapes = [TableShape(f"c{i}", rows, 16, ids_per_step=2048) for i, rows in enumerate(CRITEO)]
    plan = plan_sharding(shapes, 2)
    assert plan_sharding(list(reversed(shapes)), 2).to_json() == plan.to_json()
    kinds = {t.name: plan.placement(t.name).kind for t in shapes}
    assert {n for n, k in kinds.items() if k == "replicated"} >= {f"c{i}" for i, r in enumerate(CRITEO) if r < 100}
    assert all(kinds[f"c{i}"] == "row_wise" for i, r in enumerate(CRITEO) if r > 100_000)
    text = plan.render()
    assert "sharding plan for 2 rank(s), 26 table(s)" in text and "imbalance" in text
    assert ShardingPlan.from_json(plan.to_json(), "round trip").to_json() == plan.to_json()


def test_the_planner_counts_16_bit_exchanges_as_half_the_row_bytes():
    """TableShape(wire_bytes=2) (create_table(exchange_dtype=) 16-bit): a row-wise table's bytes
    sent are its keys plus half the float32 rows and gradients, as the exchange counts them."""
    from shardrec.rank_runtime.embedding.planner import table_cost
    from shardrec.rank_runtime.formats.sharding_plan import Placement

    wide, narrow = (table_cost(TableShape("t", 10**6, 16, ids_per_step=4096, distinct_per_step=4000, wire_bytes=b),
                               Placement("row_wise"), 2) for b in (4, 2))
    assert wide.bytes_sent == (2000 * (8 + 2 * 64),) * 2 and narrow.bytes_sent == (2000 * (8 + 2 * 32),) * 2


def test_the_planner_places_1000_tables_in_under_a_second():
    rng = np.random.default_rng(0)
    shapes = [TableShape(f"t{i}", int(r), int(d), ids_per_step=4096)
              for i, (r, d) in enumerate(zip(rng.integers(2, 10**7, 1000), rng.choice([8, 16, 64, 128], 1000)))]
    import time

    t0 = time.process_time()
    plan = plan_sharding(shapes, 8)
    assert time.process_time() - t0 < 1.0
    assert len(plan.tables) == 1000


def test_a_table_that_fits_nowhere_names_its_bytes_and_the_budgets():
    shapes = [TableShape("small", 100, 8), TableShape("huge", 10**6, 8, sharding="replicated")]
    with pytest.raises(PlanError, match=r"table 'huge' \(1000000 rows of 112 bytes\) fits in no rank's memory budget "
                                        r"under any placement allowed \(replicated: 112000000 bytes on its fullest "
                                        r"rank\); the budgets are \[50000000, 50000000\] bytes per rank"):
        plan_sharding(shapes, 2, memory_budget=50_000_000, model=CostModel())


def test_a_group_is_placed_as_one_unit_within_the_constraints_of_each_table():
    """Two tables that must be table-wise go to different ranks alone and to one rank as a group; a
    member's rank decides the group's; the plan keeps the group through its file."""
    apart = plan_sharding([TableShape("x", 5000, 16, sharding="table_wise"),
                           TableShape("y", 5000, 16, sharding="table_wise")], 2)
    assert {apart.placement("x").rank, apart.placement("y").rank} == {0, 1}
    shapes = [TableShape("x", 5000, 16, sharding="table_wise", group="g"),
              TableShape("y", 5000, 16, group="g"), TableShape("z", 40, 16, ids_per_step=64)]
    together = plan_sharding(shapes, 2)
    assert together.placement("x") == together.placement("y") and together.placement("x").kind == "table_wise"
    assert [together.tables[n].group for n in "xyz"] == ["g", "g", None]
    pinned = plan_sharding([TableShape("x", 5000, 16, group="g"),
                            TableShape("y", 5000, 16, sharding="table_wise", rank=1, group="g")], 2)
    assert pinned.placement("x").describe() == pinned.placement("y").describe() == "table_wise on rank 1"
    alone = plan_sharding([TableShape("x", 50, 8, sharding="table_wise", group="g"), TableShape("y", 50, 8, group="g"),
                           TableShape("z", 50, 8)], 1)  # one rank: every placement is allowed, row-wise chosen
    assert [alone.placement(n).describe() for n in "xyz"] == ["table_wise on rank 0"] * 2 + ["row_wise"]
    again = ShardingPlan.from_json(together.to_json(), "round trip")
    assert again.to_json() == together.to_json() and "g" in together.render().splitlines()[2]


def test_a_group_whose_tables_cannot_share_a_placement_is_refused_naming_them():
    with pytest.raises(PlanError, match=r"group 'g': its tables \['x', 'y'\] are placed together, but their sharding= "
                                        r"constraints allow no placement in common \('x': 'replicated', 'y': "
                                        r"'table_wise' on rank 1\)"):
        plan_sharding([TableShape("x", 50, 8, sharding="replicated", group="g"),
                       TableShape("y", 50, 8, sharding="table_wise", rank=1, group="g")], 2)
    with pytest.raises(PlanError, match=r"group 'g' \(tables \['x', 'y'\], placed together, 22400 bytes of rows\) "
                                        r"fits in no rank's memory budget"):
        plan_sharding([TableShape("x", 100, 8, sharding="table_wise", group="g"),
                       TableShape("y", 100, 8, group="g")], 2, memory_budget=15000)
    with pytest.raises(PlanError, match=r"table 'x': sharding group ''; allowed: a non-empty string"):
        plan_sharding([TableShape("x", 100, 8, group="")], 2)
    split = {"world_size": 2, "tables": {"x": {"sharding": "row_wise", "group": "g"},
                                         "y": {"sharding": "table_wise", "rank": 0, "group": "g"}}}
    with pytest.raises(PlanError, match=r"p.json: group 'g' places its tables apart \('x': row_wise, 'y': "
                                        r"table_wise on rank 0\)"):
        ShardingPlan.from_json(split, "p.json")


def test_create_table_places_a_later_table_of_a_group_where_the_first_went(runtime):
    first = make_table("x", sharding="replicated", sharding_group="g")
    second = make_table("y", sharding_group="g")
    assert first.placement == second.placement and second.plan.chosen_by == "group" and second.plan.group == "g"
    assert make_table("z", sharding_group="h").placement.kind == "row_wise"
    with pytest.raises(ValueError, match=r"table 'w': sharding= 'row_wise', but sharding group 'g' placed table 'x' "
                                         r"replicated and a group's tables share one placement"):
        make_table("w", sharding="row_wise", sharding_group="g")
    with pytest.raises(ValueError, match=r"table 'v': sharding group 7; allowed: a non-empty string"):
        make_table("v", sharding_group=7)


def test_a_plan_file_s_groups_reach_the_tables_and_a_different_group_is_refused(graph, tmp_path):
    lifecycle.init(sharding_plan=write_plan(tmp_path / "p.json", {"x": {"sharding": "replicated", "group": "g"},
                                                                  "y": {"sharding": "replicated", "group": "g"}}))
    assert make_table("x").plan.group == "g"  # the plan's group, create_table naming none
    with pytest.raises(ValueError, match=r"table 'y': the sharding plan puts it in sharding group 'g', create_table in "
                                         r"'h'; give the same group \(or none\) to one of them"):
        make_table("y", sharding_group="h")
