"""examples/dlrm.py: the same Criteo Kaggle-shaped samples from Parquet and from TFRecord train the
same model on one rank (the feeds hand over the same batches), and on two ranks DLRM learns from
the categorical features beyond what the dense ones alone can give."""
import os
import re
import subprocess
import sys

import pytest

from mpi_helpers import check, mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DLRM = os.path.join(ROOT, "examples", "dlrm.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("dlrm")
    check(subprocess.run([sys.executable, DLRM, "write", "--out", out, "--train-samples", "12288", "--eval-samples",
                          "4096", "--files", "2", "--row-group-rows", "1024"], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")))
    return out


def summary(proc):
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("SUMMARY")]
    return dict(re.findall(r"(\w+)=(\S+)", line))


def test_parquet_and_tfrecord_train_the_same_dlrm_on_one_rank(data):
    got = {f: summary(check(mpiexec(1, DLRM, "train", "--data", data, "--format", f, "--batch-size", 512,
                                    timeout=300))) for f in ("parquet", "tfrecord")}
    assert got["parquet"]["steps"] == got["tfrecord"]["steps"] == "24", got
    for name in ("first_loss", "final_loss", "eval_auc", "planted_auc", "eval_samples"):
        assert got["parquet"][name] == got["tfrecord"][name], (name, got)


def test_dlrm_on_two_ranks_learns_beyond_the_dense_features(data):
    import numpy as np
    import pyarrow.parquet as pq

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import criteo_synth

    got = summary(check(mpiexec(2, DLRM, "train", "--data", data, "--batch-size", 256, timeout=300)))
    held_out = pq.read_table(os.path.join(data, "parquet", "eval")).to_pydict()
    dense = np.stack([held_out[f"I{i + 1}"] for i in range(13)], axis=1)
    dense_only = criteo_synth.auc(held_out["label"], criteo_synth.dense_logit(dense, 2024))
    assert got["ranks"] == "2" and int(got["eval_samples"]) == 4096, got
    assert dense_only + 0.02 < float(got["eval_auc"]) < float(got["planted_auc"]), (dense_only, got)
    assert float(got["final_loss"]) < float(got["first_loss"]), got


def test_the_parquet_written_is_the_fast_layout_and_both_feeds_read_every_sample(data):
    """The writer's files are what the input guide calls fastest (required columns, plain, no
    compression), and bench/dlrm_feeds.py reads the same samples from both formats."""
    import json

    import pyarrow.parquet as pq

    f = pq.ParquetFile(os.path.join(data, "parquet", "train", "part-000.parquet"))
    chunks = [f.metadata.row_group(g).column(c) for g in range(f.metadata.num_row_groups)
              for c in range(f.metadata.num_columns)]
    assert {c.compression for c in chunks} == {"UNCOMPRESSED"} and not any(c.has_dictionary_page for c in chunks)
    assert not any(field.nullable for field in f.schema_arrow)
    proc = check(subprocess.run([sys.executable, os.path.join(ROOT, "bench", "dlrm_feeds.py"), "--data", data,
                                 "--rounds", "1", "--epochs", "2", "--core", "0"], capture_output=True, text=True,
                                timeout=300, cwd=ROOT))
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["samples"] == 2 * 12288 and all(v > 0 for v in report["median"].values()), report
