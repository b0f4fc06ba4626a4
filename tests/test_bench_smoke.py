"""The benchmark's short mode runs and its JSON has every row (no timing is asserted)."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_short_benchmark_writes_every_row(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run.py"), "--short", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    seen = {(r["workload"], r.get("ranks"), r["peer"]) for r in report["rows"]}
    expected = {("sparse_step", 1, "tf_premapped"), ("sparse_step", 1, "tf_premapped_ds"),
                ("sparse_step", 1, "tf_hash_table"), ("sparse_step", 1, "tfra"),
                ("scaling", 2, "2 x shardrec 1 rank on 1 core"), ("exchange_only", 2, "shardrec 1 rank (per rank)"),
                ("sparse_step", 2, "shardrec 1 rank"), ("sparse_step", 2, "tfra_horovod"),
                ("end_to_end", 2, "shardrec 1 rank"),
                ("memory", None, "payload (values + Adam slots)"), ("memory", None, "tfra"),
                ("checkpoint_save", None, "plain write+fsync of the same arrays"),
                ("checkpoint_restore", None, "plain read of the same files")}
    assert expected <= seen, expected - seen
    for row in report["rows"]:
        if row["workload"] in ("sparse_step", "end_to_end", "checkpoint_save", "checkpoint_restore") and \
                not row["peer"].startswith("tfra"):
            assert row["shardrec"] > 0 and row["peer_value"] > 0, row
    memory = [r for r in report["rows"] if r["workload"] == "memory" and r["peer"].startswith("payload")]
    assert len(memory) == 3 and "capacity = 2x keys" in memory[1]["note"]
    grown = memory[2]
    assert "dynamic expansion" in grown["note"] and 0 < grown["shardrec"] < memory[1]["shardrec"], grown
    scaling = next(r for r in report["rows"] if r["workload"] == "scaling")
    assert 0 < scaling["efficiency"] and [t["rank"] for t in scaling["timeline"]["many_ranks"]] == [0, 1]
    for t in scaling["timeline"]["many_ranks"]:
        split = t["split_ms"]
        assert any(k.startswith("moving rows: emb/ids/train#0") for k in split), split
        assert sum(v for k, v in split.items() if k != "traced span") == pytest.approx(split["traced span"]), split
    exchange = next(r for r in report["rows"] if r["workload"] == "exchange_only")
    assert exchange["two_ranks"]["keys_held"] > 0 and exchange["two_ranks"]["p99_ms"] >= exchange["two_ranks"]["median_ms"]
    e2e = next(r for r in report["rows"] if r["workload"] == "end_to_end")
    for ranks in ("1", "2"):
        assert 0 <= e2e["key_exchange_share"][ranks] < 1 and 0 <= e2e["row_exchange_share"][ranks] < 1, e2e
    assert e2e["row_exchange_share"]["2"] > 0, "2 ranks exchange rows in every step"
    assert report["machine"]["cores"] >= 1 and report["command"].startswith("bench/run.py")
    assert "| sparse_step |" in proc.stdout
    admission = {r["note"].split(";")[0]: r for r in report["rows"] if r["workload"] == "sparse_step_admission"}
    [evicting] = [row for name, row in admission.items() if name.startswith("admission 2, eviction every")]
    assert evicting["table"]["evicted"] > 0 and evicting["table"]["reused"] > 0, evicting
    assert admission["admission 2 alone"]["table"]["evicted"] == 0
    for row in admission.values():
        assert row["shardrec"] > 0 and row["peer_value"] > 0 and row["table"]["rejected"] > 0, row
    tiers = {r["note"].split(";")[0]: r for r in report["rows"] if r["workload"] == "sparse_step_tiers"}
    assert set(tiers) == {f"{share} in memory ({policy})" for share in ("10%", "1%") for policy in ("lfu", "lru")}
    for row in tiers.values():
        assert row["shardrec"] > 0 and row["peer_value"] > 0 and row["disk"]["random_4k_iops"] > 0, row
        assert row["tiers"]["rows_on_ssd"] > row["tiers"]["rows_in_memory"] > 0, row
        assert 0 < row["tiers"]["memory_hit_ratio"] < 1 and row["tiers"]["ssd_bytes_read_per_step"] > 0, row


def test_the_export_benchmark_serves_its_rows_from_variables(tmp_path):
    """bench/export.py on a small table: the served rows are checked inside it (a process without
    shardrec), and the rows land in the variables files, not the graph proto."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "export.py"), "--rows", "50000",
                           "--dir", str(tmp_path / "work")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rows"] == 50000 and result["variables_bytes"] >= 50000 * 16 * 4
    assert result["graph_proto_bytes"] < 100_000
    assert not (tmp_path / "work").exists(), "the benchmark removes what it wrote"


def test_the_records_are_the_bytes_tensorflow_s_serializer_writes():
    """bench/workload.py encodes its tf.train.Example records with numpy; TensorFlow's own
    serializer writes the same bytes, and parses them back to the same ids."""
    import numpy as np
    import tensorflow as tf

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import workload

    rng = np.random.default_rng(0)
    ids = np.concatenate([rng.integers(0, 2**40, (300, 26)), np.zeros((1, 26), np.int64),
                          np.full((1, 26), 2**62, np.int64)])
    rows = rng.integers(0, 2**20, ids.shape)
    fast = workload.serialized_examples({"ids": ids, "rows": rows})
    want = [tf.train.Example(features=tf.train.Features(feature={
        "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=a)),
        "rows": tf.train.Feature(int64_list=tf.train.Int64List(value=b))})).SerializeToString()
        for a, b in zip(ids.tolist(), rows.tolist())]
    assert fast == want
    parsed = tf.train.Example.FromString(fast[-1]).features.feature
    assert list(parsed["ids"].int64_list.value) == [2**62] * 26
    with pytest.raises(ValueError, match="non-negative"):
        workload.serialized_examples({"ids": -ids})


def test_the_row_dtypes_benchmark_reports_every_configuration_against_float32():
    """bench/row_dtypes.py in a few small steps: a line per (optimizer, dim) with every configuration's
    bytes per row (the table's counters) and CPU time; 16-bit columns hold fewer bytes per row."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "row_dtypes.py"), "--dims", "8",
                           "--optimizers", "lazy_adam", "--rounds", "1", "--steps", "2", "--warmup", "1",
                           "--batch", "64"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    [line] = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    sizes = {c: line[c]["bytes_per_row"] for c in ("float32", "float16", "bfloat16", "float16+bf16_slots")}
    assert sizes == {"float32": 3 * 8 * 4 + 13, "float16": 8 * 2 + 2 * 8 * 4 + 13, "bfloat16": 8 * 2 + 2 * 8 * 4 + 13,
                     "float16+bf16_slots": 3 * 8 * 2 + 13}, sizes
    assert all(line[c]["cpu_us_per_id"] > 0 for c in sizes)


def test_the_placements_benchmark_runs_one_table_under_each_placement_on_two_ranks():
    """bench/placements.py in one small round: a job per placement, each with its CPU time per id,
    every ratio to the first placement (row-wise) printed."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "placements.py"), "--rounds", "1",
                           "--placements", "row_wise", "column_wise", "--dim", "8", "--batch", "256", "--fields", "4",
                           "--steps", "4", "--warmup", "1", "--windows", "1", "--batches", "4", "--feed", "step-only"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    report = json.loads(proc.stdout.splitlines()[-1])
    assert [r["placement"] for r in report["runs"]] == ["row_wise", "column_wise"]
    assert all(r["cpu_ns_per_id"] > 0 and r["ids_per_s"] > 0 for r in report["runs"])
    assert re.search(r"round 1: row_wise 1\.00x, column_wise \d+\.\d\dx", proc.stdout), proc.stdout


def test_the_serving_threads_benchmark_answers_every_request_under_each_setting():
    """bench/serve_threads.py in one short round: a server per inter-op setting, each API's
    one-at-a-time and open-loop figures, no request refused."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "serve_threads.py"), "--keys", "20000",
                           "--rounds", "1", "--sequential", "10", "--rate", "50", "--load-s", "1"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted((r["setting"], r["api"]) for r in report["rounds"]) == [(-1, "grpc"), (-1, "rest"), (0, "grpc"),
                                                                          (0, "rest")]
    for r in report["rounds"]:
        assert r["load"]["requests"] == 50 and r["load"]["errors"] == 0, r
        assert r["sequential"]["p50_ms"] > 0 and r["load"]["p99_ms"] >= r["load"]["p50_ms"], r
    assert set(report["medians"]) == {"-1_rest", "-1_grpc", "0_rest", "0_grpc"}
