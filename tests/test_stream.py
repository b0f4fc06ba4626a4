"""Training from a stream: files counted by their framing and damaged ones named, positions saved
with every checkpoint, a save of the wrong step refused, and jobs killed, resized and stopped that
train every record exactly once (the broker's own faults: test_stream_broker.py)."""
import glob
import os
import re
import shutil
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from mpi_helpers import check, mpiexec
from shardrec.launch.redis_server import free_port
from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows
from shardrec.rank_runtime.formats.stream_positions import PartitionPosition
from shardrec.rank_runtime.stream import StreamFileError
from shardrec.rank_runtime.stream.tfrecord_files import count_records
from stream_helpers import FIELDS, counted, events, produce, produce_parquet, publish, reader

def test_a_file_is_counted_by_its_framing_and_a_cut_one_is_named(tmp_path):
    produce(tmp_path, 1, 1, 7)
    [path] = glob.glob(str(tmp_path / "0" / "*.tfrecord"))
    assert count_records(path, "0") == 7
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-5])
    with pytest.raises(StreamFileError, match=r"partition '0'.*record 6 at byte \d+ says \d+ bytes, past the file's end"):
        count_records(path, "0")


def _record_starts(path):
    """Where each record of a TFRecord file starts, from its framing (8-byte length, 4-byte CRC, the
    data, 4-byte CRC), read here in Python as the oracle of the native count."""
    data, starts, at = open(path, "rb").read(), [], 0
    while at < len(data):
        starts.append(at)
        at += 16 + int.from_bytes(data[at:at + 8], "little")
    return starts


def test_a_record_with_a_flipped_byte_is_named_by_partition_file_and_offset(tmp_path):
    """A byte flipped in the data of record 3 of a partition's second file (its length's CRC
    intact): the job trains the first file, then stops with an error naming the partition, the
    file and the record's byte offset (TensorFlow's reader says only `DataLossError: corrupted record
    at N`)."""
    stream = tmp_path / "stream"
    produce(stream, 1, 2, 10)
    path = str(stream / "0" / "events-00001.tfrecord")
    bad = _record_starts(path)[3]
    data = bytearray(open(path, "rb").read())
    data[bad + 12 + 5] ^= 0x10
    open(path, "wb").write(bytes(data))
    with pytest.raises(StreamFileError, match=rf"partition '0': {re.escape(path)}: record 3 at byte {bad} .*the CRC of "
                                              "its data does not match"):
        count_records(path, "0")
    proc = mpiexec(1, "stream_job.py", "--stream", stream, "--partitions", 1, "--out", tmp_path, "--tag", "crc",
                   "--model", tmp_path / "model", "--idle", 2, timeout=120)
    assert proc.returncode != 0
    assert f"stream partition '0': {path}: record 3 at byte {bad}" in proc.stderr, proc.stderr[-3000:]
    assert "DataLossError" not in proc.stderr, proc.stderr[-3000:]


def test_a_file_read_to_its_end_may_go_and_is_not_counted_again_while_waiting(tmp_path, monkeypatch):
    """The reader alone (no MPI): once a file was handed out whole, waiting for the next one neither
    counts it again at every poll nor needs it (a producer's retention may remove it)."""
    from shardrec.rank_runtime.formats.stream_positions import PartitionPosition as Position
    from shardrec.rank_runtime.stream import directory
    from shardrec.rank_runtime.stream.cursor import StreamCursor

    produce(tmp_path, 1, 2, 5)
    stream = directory.DirectoryStream(tmp_path, 1, idle_timeout_s=0.3, poll_s=0.05)
    stream.owned, stream.cursor = ["0"], StreamCursor({"0": Position(None, 0)})
    counted = []
    monkeypatch.setattr(directory, "count_records", lambda path, p: counted.append(os.path.basename(path)) or 5)
    slices = stream._read(stream.cursor, None)
    assert [os.path.basename(next(slices)[0]) for _ in range(2)] == ["events-00000.tfrecord", "events-00001.tfrecord"]
    os.remove(tmp_path / "0" / "events-00000.tfrecord")
    os.remove(tmp_path / "0" / "events-00001.tfrecord")
    assert list(slices) == []  # idle for 0.3 s: the data ends, without an error
    assert counted == ["events-00000.tfrecord", "events-00001.tfrecord"]


def _load(out, tag, size):
    parts = [np.load(out / f"{tag}-rank{r}-of{size}.npz") for r in range(size)]
    keys = np.concatenate([p["keys"] for p in parts])
    order = np.argsort(keys)
    return parts, keys[order], np.concatenate([p["values"] for p in parts])[order]


@pytest.mark.parametrize("source", ["directory", "redis", "parquet"])
def test_a_rank_killed_mid_run_resumes_every_partition_where_its_checkpoint_stood(tmp_path, source, request):
    """4 partitions, 2 ranks, batches of 8: 3 files of 24 records a partition are 18 steps. Rank 1
    is SIGKILLed after step 7 (checkpoints every 5 steps: the latest is step 5, and tf.data had
    read ahead of it); the restarted job resumes from step 5 and ends with the tables, bit for
    bit, of a job that was never stopped, having trained each record once; so does the job under
    the supervisor with rank 1 killed inside its save of step 10. The same records from a
    directory of TFRecord files (SGD), from Redis streams (lazy Adam) in blocks of 16 entries of 5,
    1, 7 and 4 records in turn, so that the save cuts a packed entry, and from a directory of
    Parquet files in row groups of 10 (SGD), so that batches and saves cut row groups."""
    if source in ("directory", "parquet"):
        stream = tmp_path / "stream"
        ids = (produce if source == "directory" else produce_parquet)(stream, 4, 3, 24)
        where = ["--stream", stream] + (["--parquet-stream"] if source == "parquet" else [])
        ends = {str(p): PartitionPosition(f"events-00002.{'tfrecord' if source == 'directory' else 'parquet'}", 24)
                for p in range(4)}
    else:
        import redis

        url, name = request.getfixturevalue("broker").url, tmp_path.name
        ids = publish(url, name, 4, 3, 24, packs=(5, 1, 7, 4))
        where = ["--stream", name, "--broker", url]
        client = redis.Redis.from_url(url)
        ends = {str(p): PartitionPosition(client.xrevrange(f"{name}:{p}", count=1)[0][0].decode(), 3 * 7)
                for p in range(4)}
    common = [*where, "--partitions", 4, "--out", tmp_path, "--every", 5, "--idle", 2, "--access-threshold", 3,
              "--optimizer", "lazy_adam" if source == "redis" else "sgd"]
    check(mpiexec(2, "stream_job.py", *common, "--tag", "straight", "--model", tmp_path / "straight", timeout=240))
    killed = mpiexec(2, "stream_job.py", *common, "--tag", "killed", "--model", tmp_path / "resumed", "--die-at", 7,
                     timeout=240)
    assert killed.returncode != 0
    assert tf.train.latest_checkpoint(str(tmp_path / "resumed")).endswith("model-5")
    # A copy of the same checkpoint (its state file naming the copy) restored into 1 rank: it reads
    # all 4 partitions from where they stood.
    shutil.copytree(tmp_path / "resumed", tmp_path / "resized")
    (tmp_path / "resized" / "checkpoint").write_text('model_checkpoint_path: "model-5"\n'
                                                    'all_model_checkpoint_paths: "model-5"\n')
    if source == "redis":  # the save of step 5 cut a packed entry of a partition
        assert any(pos.within for pos in counted(tmp_path / "resized")[2].values())
    check(mpiexec(2, "stream_job.py", *common, "--tag", "resumed", "--model", tmp_path / "resumed", timeout=240))
    check(mpiexec(1, "stream_job.py", *common, "--tag", "resized", "--model", tmp_path / "resized", timeout=240))
    midsave = _killed_in_save_under_the_supervisor(tmp_path, common)
    straight, keys, values = _load(tmp_path, "straight", 2)
    resumed, resumed_keys, resumed_values = _load(tmp_path, "resumed", 2)
    assert [int(p["step"]) for p in straight] == [18, 18] == [int(p["step"]) for p in resumed]
    assert sum(int(p["records"]) for p in straight) == len(ids)
    assert sum(int(p["records"]) for p in resumed) == len(ids) - 5 * 8 * 2
    seen, times = np.unique(ids, return_counts=True)
    admitted = seen[times >= 3]
    np.testing.assert_array_equal(keys, admitted)
    np.testing.assert_array_equal(resumed_keys, keys)
    np.testing.assert_array_equal(resumed_values, values)
    np.testing.assert_array_equal(resumed[0]["w"], straight[0]["w"])
    _, midsave_keys, midsave_values = _load(tmp_path, "midsave", 2)
    np.testing.assert_array_equal(midsave_keys, keys)
    np.testing.assert_array_equal(midsave_values, values)
    assert [int(p["step"]) for p in midsave] == [18, 18]
    [resized] = [np.load(tmp_path / "resized-rank0-of1.npz")]
    assert int(resized["records"]) == len(ids) - 5 * 8 * 2 and int(resized["step"]) == 5 + 26
    np.testing.assert_array_equal(np.sort(resized["keys"]), keys)
    for model in ("straight", "resumed", "resized", "midsave"):
        # Admission's counts: every key counted as often as the stream holds it, no batch twice.
        keys_counted, counts, positions, _ = counted(tmp_path / model)
        np.testing.assert_array_equal(keys_counted, seen, err_msg=model)
        np.testing.assert_array_equal(counts, times, err_msg=model)
        assert positions == ends, (model, positions)


def _killed_in_save_under_the_supervisor(tmp_path, common):
    """The job under shardrec-run, rank 1 SIGKILLing itself inside its save of step 10 (its arrays
    written, its manifest not): the supervisor restarts it from step 5, and it ends with exit 0.
    Returns the ranks' outputs."""
    import sys

    from mpi_helpers import JOBS
    from supervisor_helpers import shardrec_run

    model = tmp_path / "midsave"
    proc = shardrec_run("-np", 2, "--checkpoint-dir", model, "--run-dir", tmp_path / "midsave-run",
                        "--restart-delay", 1, "--", sys.executable, os.path.join(JOBS, "stream_job.py"), *common,
                        "--tag", "midsave", "--model", model, "--die-in-save", 10, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert (tmp_path / "midsave-run" / "attempt-1").exists() and not (tmp_path / "midsave-run" / "attempt-2").exists()
    assert re.search(r"restarting the job in 1 s \(attempt 1 of \d+\) from \S+model-5 \(step 5\)", proc.stderr), \
        proc.stderr[-5000:]
    return [np.load(tmp_path / f"midsave-rank{r}-of2.npz") for r in range(2)]


def test_a_restore_at_the_end_of_a_files_goes_on_with_the_next_partition(tmp_path):
    """A save that ended exactly at the end of a file of partition 0 (its resume partition): the job
    that never stopped read partition 1 next, and so does the restored one."""
    from shardrec.rank_runtime.stream import directory

    produce(tmp_path, 2, 2, 4)
    stream = directory.DirectoryStream(tmp_path, 2, idle_timeout_s=0.2, poll_s=0.05)
    cut = reader(stream, {"0": PartitionPosition("events-00000.tfrecord", 2), "1": PartitionPosition(None, 0)}, "0")
    assert [(os.path.relpath(path, tmp_path), first) for path, first in cut][:2] == [
        ("0/events-00000.tfrecord", 2), ("1/events-00000.tfrecord", 0)]
    ended = reader(stream, {"0": PartitionPosition("events-00000.tfrecord", 4), "1": PartitionPosition(None, 0)}, "0")
    assert [(os.path.relpath(path, tmp_path), first) for path, first in ended][:2] == [
        ("1/events-00000.tfrecord", 0), ("0/events-00001.tfrecord", 0)]


def test_a_save_whose_global_step_is_not_the_graph_s_is_refused_and_saves_nothing(tmp_path):
    """2 ranks on a directory stream with admission counting keys: after step 5 the script saves with
    global_step=4. Every rank gets an error naming both numbers, nothing of model-4 is written, the
    job goes on; its final save (the right step) holds every key counted once per occurrence."""
    stream, model = tmp_path / "stream", tmp_path / "model"
    ids = produce(stream, 2, 3, 24)
    proc = check(mpiexec(2, "stream_job.py", "--stream", stream, "--partitions", 2, "--out", tmp_path, "--tag", "w",
                         "--model", model, "--every", 100, "--idle", 2, "--access-threshold", 2, "--wrong-step-at", 5,
                         timeout=240))
    refusals = re.findall(r"WRONG-STEP-REFUSED rank (\d): (.*)", proc.stdout)
    assert sorted(r for r, _ in refusals) == ["0", "1"], proc.stdout[-3000:]
    for _, message in refusals:
        assert "global_step=4, but the graph's global step is 5" in message and "nothing was saved" in message, message
    assert not [n for n in os.listdir(model) if "model-4" in n], os.listdir(model)
    keys, counts, positions, step = counted(model)
    assert step == len(ids) // (2 * 8) and sum(int(np.load(tmp_path / f"w-rank{r}-of2.npz")["records"]) for r in range(2)) \
        == len(ids)
    seen, times = np.unique(ids, return_counts=True)
    np.testing.assert_array_equal(keys, seen)
    np.testing.assert_array_equal(counts, times)


def _sorted_rows(model):
    """Every array of table emb in the latest checkpoint of `model` (rows, slots, counts), by key."""
    [ckpt] = find_checkpoints(tf.train.latest_checkpoint(str(model)))
    rows = table_rows(ckpt, "emb")
    by_key, by_pending = np.argsort(rows["keys"]), np.argsort(rows["pending_keys"])
    return {name: array[by_pending if name.startswith("pending") else by_key] for name, array in rows.items()}


def _ids_up_to(ids_by_file, positions, files, directory):
    """The ids of the records before each partition's position: what the checkpoint trained."""
    taken = []
    for p, pos in positions.items():
        whole = [ids_by_file[f, int(p)] for f in range(files)]
        if directory:
            done = 0 if pos.file is None else int(pos.file.split("-")[1].split(".")[0])
            taken += whole[:done] + ([whole[done][:pos.offset]] if pos.file is not None else [])
        else:
            taken.append(np.concatenate(whole)[:pos.offset])
    return np.concatenate(taken) if taken else np.zeros((0, FIELDS), np.int64)


class _Drained:
    """Whether the attempt's ranks have trained all there was: every rank is at step `at_least` or
    later (the reader runs ahead of the steps, so it waits for data before the first step of an
    attempt), a rank waits for stream data, and beats of every rank a heartbeat tick (5 s) later
    find the same steps, still waiting (a reader that waits and gets data again writes beats within
    one step). Called again and again (waits.wait_for): each call compares the beats with those of
    the first that saw a rank waiting."""

    def __init__(self, run, attempt, ranks, at_least):
        self.files = [run / f"attempt-{attempt}" / "heartbeat" / f"rank-{r}.json" for r in range(ranks)]
        self.at_least = at_least
        self.first = None

    def _beats(self):
        import json

        try:
            return [json.loads(f.read_text()) for f in self.files]
        except (OSError, ValueError):
            return None

    def __call__(self):
        beats = self._beats()
        if not beats or not any(b.get("waiting_for_data") for b in beats) \
                or not all((b.get("step") or 0) >= self.at_least for b in beats):
            self.first = None
            return False
        if self.first is None or [b.get("step") for b in beats] != [b.get("step") for b in self.first]:
            self.first = beats
            return False
        return all(b["time"] >= a["time"] + 5.0 for a, b in zip(self.first, beats))


@pytest.mark.parametrize("source", ["directory", "redis"])
def test_a_supervised_stream_job_trains_every_record_once_across_a_kill_a_shrink_a_grow_and_sigterm(
        tmp_path, source, request):
    """Under shardrec-run with a discovery script: 2 ranks; rank 1 SIGKILLed after step 7 while one
    slot is left (the job goes on on 1 rank from checkpoint 5, every partition from where it
    stood); two slots again (it saves, stops and goes on on 2); more data is produced; once the
    stream has nothing new, SIGTERM: every rank finishes its step, saves, and the supervisor exits
    0. The final checkpoint's admission counts are exactly the occurrences of every key in the
    records before its positions, those positions hold at least every record of the first data,
    and its tables equal, bit for bit, those of a job that trained the same records on as many
    ranks for the same steps without being killed (SGD from the directory, lazy Adam from Redis)."""
    import signal
    import subprocess
    import sys

    from mpi_helpers import JOBS
    from supervisor_helpers import RUN, run_env
    from elastic_helpers import beat_step, discovery, elastic_args, started, stopped_at_the_end
    from waits import wait_for

    ids_by_file = {}
    events(4, 5, 24, ids_by_file=ids_by_file)
    if source == "directory":
        stream = tmp_path / "stream"
        produce(stream, 4, 5, 24, only_files={0, 1, 2})
        where, more = ["--stream", stream], lambda: produce(stream, 4, 5, 24, only_files={3, 4})
    else:
        url, name = request.getfixturevalue("broker").url, tmp_path.name
        publish(url, name, 4, 5, 24, only_files={0, 1, 2})
        where, more = ["--stream", name, "--broker", url], lambda: publish(url, name, 4, 5, 24, only_files={3, 4})
    model, out, run = tmp_path / "model", tmp_path / "out", tmp_path / "run"
    out.mkdir()
    optimizer = ["--optimizer", "sgd" if source == "directory" else "lazy_adam"]
    script, listing = discovery(tmp_path, "localhost:2\n")
    cmd = [RUN, "-np", 2, "--checkpoint-dir", model, "--run-dir", run, "--restart-delay", 1, *elastic_args(script),
           "--", sys.executable, os.path.join(JOBS, "stream_job.py"), *where, "--partitions", 4, "--out", out,
           "--tag", "end", "--model", model, "--every", 5, "--die-at", 7, "--idle", 0, "--step-delay", 0.3,
           "--access-threshold", 3, *optimizer]
    port = free_port()
    proc = subprocess.Popen(list(map(str, cmd)), env=run_env(SHARDREC_METRICS_PORT=str(port)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    with stopped_at_the_end(proc):
        wait_for(lambda: beat_step(run, 0) >= 3, proc, 240, "step 3")
        listing.write_text("localhost:1\n")
        wait_for(lambda: beat_step(run, 1) >= 8, proc, 240, "step 8 of attempt 1")
        listing.write_text("localhost:2\n")
        wait_for(lambda: (run / "attempt-2" / "command.json").exists(), proc, 240, "attempt 2")
        more()
        # Records at step T >= the grow's checkpoint G: 2 ranks x 8 to step 5, 1 rank x 8 to G, then
        # 2 x 8 a step; the first data (288 records) is trained by step G + ceil((208 - 8 (G - 5)) / 16).
        grown = int(started(run, 2)[2].rsplit("-", 1)[1])
        first_data = grown + max(0, -(-(4 * 3 * 24 - 80 - 8 * (grown - 5)) // 16))
        wait_for(_Drained(run, 2, 2, first_data), proc, 240, f"every record trained (step {first_data} or later)")
        figures = _scrape(port)  # rank 0 of attempt 2: one restart (the kill) and one resize (the grow) before
        assert [figures[(f"shardrec_supervisor_{n}", (("rank", "0"),))] for n in ("restarts", "resizes", "attempt")] \
            == [1, 1, 2], figures
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-5000:]
    assert [started(run, a)[0] for a in range(3)] == [2, 1, 2] and not (run / "attempt-3").exists(), stderr[-4000:]
    assert started(run, 1)[2].endswith("model-5"), stderr[-4000:]
    assert "stopped: asked to by signal 15; every rank saved and exited at step" in stderr, stderr[-3000:]
    keys, counts, positions, step = counted(model)
    assert sorted(positions) == ["0", "1", "2", "3"]
    trained = _ids_up_to(ids_by_file, positions, 5, source == "directory")
    seen, times = np.unique(trained, return_counts=True)
    np.testing.assert_array_equal(keys, seen)
    np.testing.assert_array_equal(counts, times)
    assert len(trained) >= 4 * 3 * 24, positions  # all of the first data, and what the ranks had of the rest
    final = [np.load(out / f"end-rank{r}-of2.npz") for r in range(2)]
    assert [int(f["step"]) for f in final] == [step, step]
    assert len(find_checkpoints(str(model))) <= 3  # Saver(max_to_keep=3), across every attempt
    # The same records trained without a kill, by as many ranks for the same steps (2 ranks to step
    # 5, 1 to the step the grow saved, 2 to the end): the same tables and dense part, bit for bit.
    for ranks, stop in ((2, 5), (1, grown), (2, step)):
        check(mpiexec(ranks, "stream_job.py", *where, "--partitions", 4, "--out", out, "--tag", "reference",
                      "--model", tmp_path / "reference", "--every", 5, "--idle", 2, "--access-threshold", 3,
                      "--stop-at", stop, *optimizer, timeout=240))
    reference = [np.load(out / f"reference-rank{r}-of2.npz") for r in range(2)]
    assert [int(r["step"]) for r in reference] == [step, step]
    np.testing.assert_array_equal(final[0]["w"], reference[0]["w"])
    # The checkpoints (the ranks' own tables hold rows tf.data looked up ahead of the last step).
    got, want = _sorted_rows(model), _sorted_rows(tmp_path / "reference")
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _scrape(port):
    """Every sample of the endpoint, by (name, labels), as prometheus_client's parser reads them."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_metrics_endpoint_of_every_rank_is_scraped_and_parsed_and_sigterm_to_the_ranks_saves(tmp_path):
    """A 2-rank stream job with the endpoint on every rank (SHARDREC_METRICS_EVERY_RANK): scraped
    over HTTP while it trains, each partition's trained and lagging records add up to what the
    producer wrote; once the stream is drained, the figures equal the job's own (samples, rows,
    admissions, the last save). SIGTERM sent to the ranks themselves: they save and exit 0."""
    import psutil

    stream, model = tmp_path / "stream", tmp_path / "model"
    produce(stream, 4, 3, 24)
    port = free_port()
    while port + 1 > 65535 or not _port_free(port + 1):
        port = free_port()
    result = {}
    env = {"SHARDREC_METRICS_PORT": str(port), "SHARDREC_METRICS_EVERY_RANK": "1", "SHARDREC_PROGRESS_S": "1"}
    job = threading.Thread(target=lambda: result.update(proc=mpiexec(
        2, "stream_job.py", "--stream", stream, "--partitions", 4, "--out", tmp_path, "--tag", "m", "--model", model,
        "--every", 5, "--idle", 0, "--step-delay", 0.2, "--access-threshold", 3, env=env, timeout=240)))
    job.start()
    deadline, mid = time.monotonic() + 180, None
    while mid is None:
        assert job.is_alive() and time.monotonic() < deadline, result
        try:
            got = _scrape(port)
        except OSError:
            time.sleep(0.2)
            continue
        if got.get(("shardrec_samples_total", (("rank", "0"),)), 0) >= 16:
            mid = got
    for p in ("0", "2"):  # rank 0's partitions, mid-run
        key = (("partition", p), ("rank", "0"))
        assert mid[("shardrec_stream_trained_records", key)] + mid[("shardrec_stream_lag_records", key)] == 72, mid
        assert mid[("shardrec_stream_lag_seconds", key)] >= 0
    drained = {}
    while len(drained) < 2:  # every record trained: 144 samples a rank, saves at 5, 10 and 15
        assert job.is_alive() and time.monotonic() < deadline, result
        for rank in (0, 1):
            got = _scrape(port + rank)
            if got.get(("shardrec_samples_total", (("rank", str(rank)),))) == 144 and \
                    got.get(("shardrec_last_save_step", (("kind", "full"), ("rank", str(rank))))) == 15:
                drained[rank] = got
        time.sleep(0.2)
    ranks = [p for p in psutil.process_iter(["cmdline", "name"]) if p.info["name"].startswith("python") and
             str(model) in " ".join(p.info["cmdline"] or [])]
    assert len(ranks) == 2, ranks
    for rank_process in ranks:
        rank_process.terminate()
    job.join(120)
    proc = check(result["proc"])
    assert "progress: " in proc.stderr and "lag partition 0: " in proc.stderr, proc.stderr[-3000:]
    for rank in (0, 1):
        got, final = drained[rank], np.load(tmp_path / f"m-rank{rank}-of2.npz")
        r = (("rank", str(rank)),)
        assert int(final["step"]) == 18 and int(final["records"]) == 144
        for p in range(rank, 4, 2):
            key = (("partition", str(p)),) + r
            assert (got[("shardrec_stream_trained_records", key)], got[("shardrec_stream_lag_records", key)],
                    got[("shardrec_stream_lag_seconds", key)]) == (72, 0, 0)
        rows = got[("shardrec_table_rows", r[:0] + r + (("table", "emb"),))]
        assert rows == len(final["keys"]) == got[("shardrec_admitted_total", r + (("table", "emb"),))]
        assert got[("shardrec_evicted_total", r + (("table", "emb"),))] == 0
        assert got[("shardrec_last_save_bytes", (("kind", "full"),) + r)] > 0
        assert got[("shardrec_supervisor_restarts", r)] == 0 == got[("shardrec_supervisor_resizes", r)]
    keys, counts, positions, step = counted(model)
    assert step == 18  # the save at SIGTERM
    assert positions == {str(p): PartitionPosition("events-00002.tfrecord", 24) for p in range(4)}


def _port_free(port):
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
