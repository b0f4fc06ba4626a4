import fcntl
import gc
import json
import os
import pathlib
import subprocess
import sys

import pytest
import tensorflow as tf

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf.compat.v1.disable_eager_execution()
gc.freeze()  # TensorFlow's modules out of the collector's way, as init() does in a rank
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from shardrec.rank_runtime.process import lifecycle  # noqa: E402


# The files that take longest, longest first (seconds each on this 2-core VM in a clean clone's
# `make test ARGS=--durations=0`, 2026-11-27: 323 for test_elastic down to 33 for test_estimator; 3412
# in all; test_parquet_jobs and test_dlrm, about 70 s each, measured alone): make test's two workers
# take a file at a time in collection order, so the longest go first and no long file is left to
# run alone at the end.
LONGEST_FIRST = ("test_elastic.py", "test_stream.py", "test_tiers.py", "test_incremental.py", "test_multi_host.py",
                 "test_supervisor.py", "test_demo.py", "test_bench_smoke.py", "test_checkpoint.py",
                 "test_multi_rank.py", "test_admission.py", "test_pooled_lookup.py", "test_sharding.py",
                 "test_live_serving.py", "test_grpc_serving.py",
                 "test_exchange_faults.py", "test_parquet_jobs.py", "test_dlrm.py", "test_serving.py", "test_setup.py",
                 "test_row_dtypes.py", "test_expansion.py", "test_host_defaults.py", "test_table_only_model.py", "test_graph_modification.py",
                 "test_stream_broker.py", "test_estimator.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept


def pytest_unconfigure(config):
    """This process is an MPI singleton once a test started MPI in it (init(), or mpi4py alone):
    nothing else removes its segment from /dev/shm when it exits, and a test process that never
    called init() (one that ran only the native tests) would leave it."""
    if "mpi4py.MPI" in sys.modules:
        from shardrec.rank_runtime.process.world import unlink_own_segments

        unlink_own_segments()


@pytest.fixture
def graph():
    """A fresh default graph; shardrec is terminated afterwards whatever the test did."""
    g = tf.Graph()
    with g.as_default():
        yield g
    lifecycle.terminate_config_initializer()


@pytest.fixture
def runtime(graph):
    """init() with defaults (dynamic shapes) inside a fresh graph."""
    lifecycle.init()
    return graph


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, worker_id):
    """The supervisor's test job run once without faults on one host (tests/supervisor_helpers.py),
    with a memory share low enough that every rank is reported: the oracle of every supervised run.
    Once for the whole session: under xdist the first worker that asks runs it in the session's
    shared temporary directory, under a lock, and the others read what it left there."""
    from supervisor_helpers import train

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    done = shared / "reference-run.json"
    with open(shared / "reference-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            (shared / "reference").mkdir()
            proc, out, run = train(shared / "reference", "ref", extra=("--memory-share", 0.001))
            assert proc.returncode == 0, proc.stderr[-4000:]
            done.write_text(json.dumps({"args": proc.args, "stderr": proc.stderr, "out": str(out), "run": str(run)}))
        saved = json.loads(done.read_text())
    proc = subprocess.CompletedProcess(saved["args"], 0, "", saved["stderr"])
    return proc, pathlib.Path(saved["out"]), pathlib.Path(saved["run"])


@pytest.fixture(scope="session")
def uninterrupted(reference_run):
    return reference_run[1]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """A Redis server of the test module's own (Debian's redis-server), for stream tests."""
    from shardrec.launch.redis_server import RedisServer

    with RedisServer(str(tmp_path_factory.mktemp("redis"))) as server:
        yield server
