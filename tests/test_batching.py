"""shardrec-serve's batcher (rank_runtime/serving/live/batching.py) on its own, over a numpy model
(y = 2x per instance, plus its batch's size): concurrent requests run together within
max_batch_size, each gets exactly its own rows, a request larger than a batch runs alone, a full
queue refuses, a request the model refuses fails alone, and a signature whose outputs are not one
row per instance falls back to running each request alone."""
import threading
import time

import numpy as np
import pytest

from shardrec.rank_runtime.serving.live.batching import Batcher, BatchOptions, QueueFull
from shardrec.rank_runtime.serving.live.model_graph import Signature

SIGNATURE = Signature("serving_default", {}, {}, None)


class Model:
    def __init__(self, delay=0.0, per_instance=True):
        self.batches, self.delay, self.per_instance = [], delay, per_instance
        self.lock = threading.Lock()

    def __call__(self, signature, feeds):
        x = feeds["x"]
        with self.lock:
            self.batches.append(len(x))
        time.sleep(self.delay)
        if (x < 0).any():
            raise ValueError("negative input")
        y = {"y": x * 2.0, "n": np.full(len(x), len(x))}
        if not self.per_instance:
            y["total"] = np.array(x.sum())
        return y, "v1"


def _ask(batcher, sizes, start=0):
    """One thread per request; returns {request: (outputs or the exception, its x)}."""
    out = {}

    def one(i, n):
        x = np.arange(n, dtype=np.float64) + 1000 * (i + start)
        try:
            out[i] = (batcher.run(SIGNATURE, {"x": x}), x)
        except Exception as e:
            out[i] = (e, x)

    threads = [threading.Thread(target=one, args=(i, n)) for i, n in enumerate(sizes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_concurrent_requests_run_together_within_the_batch_size_and_each_gets_its_rows():
    model = Model(delay=0.02)
    batcher = Batcher(model, BatchOptions(max_batch_size=20, batch_timeout_micros=50_000, num_batch_threads=1))
    sizes = [3, 5, 7, 2, 4, 6, 1, 8]
    out = _ask(batcher, sizes)
    batcher.close()
    for i, ((outputs, version), x) in out.items():
        np.testing.assert_array_equal(outputs["y"], x * 2.0)
        assert version == "v1" and outputs["y"].shape == (sizes[i],)
    assert sum(model.batches) == sum(sizes) and max(model.batches) <= 20, model.batches
    assert len(model.batches) < len(sizes), model.batches  # some ran together


def test_a_request_larger_than_a_batch_runs_alone_and_a_full_queue_refuses():
    model = Model(delay=0.2)
    batcher = Batcher(model, BatchOptions(max_batch_size=4, num_batch_threads=1, max_enqueued_batches=1))
    out = _ask(batcher, [9])
    assert model.batches == [9] and out[0][0][0]["y"].shape == (9,)
    out = _ask(batcher, [3, 3, 3, 3])  # one runs, one batch's worth (4 instances) may wait: the rest refused
    refused = [i for i, (got, _) in out.items() if isinstance(got, QueueFull)]
    served = [i for i, (got, _) in out.items() if not isinstance(got, Exception)]
    assert refused and served and len(refused) + len(served) == 4, out
    assert "--max-enqueued-batches" in str(out[refused[0]][0])
    batcher.close()


def test_a_request_the_model_refuses_fails_alone():
    model = Model(delay=0.05)
    batcher = Batcher(model, BatchOptions(max_batch_size=100, batch_timeout_micros=100_000, num_batch_threads=1))
    out = {}

    def one(i, x):
        try:
            out[i] = batcher.run(SIGNATURE, {"x": x})
        except Exception as e:
            out[i] = e

    xs = [np.array([1.0, 2.0]), np.array([-1.0]), np.array([3.0])]
    threads = [threading.Thread(target=one, args=(i, x)) for i, x in enumerate(xs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    batcher.close()
    assert isinstance(out[1], ValueError)
    np.testing.assert_array_equal(out[0][0]["y"], [2.0, 4.0])
    np.testing.assert_array_equal(out[2][0]["y"], [6.0])


def test_outputs_that_are_not_one_row_per_instance_make_the_signature_run_alone():
    model = Model(delay=0.05, per_instance=False)
    batcher = Batcher(model, BatchOptions(max_batch_size=100, batch_timeout_micros=100_000, num_batch_threads=1))
    out = _ask(batcher, [2, 3, 4])
    for i, ((outputs, _), x) in out.items():
        assert outputs["total"] == x.sum() and list(outputs["n"]) == [len(x)] * len(x)
    later = _ask(batcher, [2, 2])
    batcher.close()
    for (outputs, _), x in later.values():
        assert outputs["total"] == x.sum()


@pytest.mark.parametrize("bad", [dict(max_batch_size=0), dict(num_batch_threads=0), dict(batch_timeout_micros=-1),
                                 dict(max_enqueued_batches=0)])
def test_options_out_of_range_are_named(bad):
    with pytest.raises(ValueError, match="must be >= 1"):
        BatchOptions(**bad)
