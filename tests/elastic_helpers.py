"""What the elastic tests share (test_elastic.py, test_multi_host.py, test_stream.py): a discovery
script the test rewrites, the supervisor stopped at the end, an attempt's start and its ranks' steps
as the supervisor's run directory tells them, a checkpoint's rows as shardrec-ckpt
reads them, and the elastic job compared with a user restarting by hand on the same ranks."""
import contextlib
import json
import os
import shutil

import numpy as np

from mpi_helpers import check, mpiexec


def rows_of(directory, name, table="emb"):
    """Every rank's rows of `table` in checkpoint `name` of `directory`, by key, read as
    shardrec-ckpt export reads them (no TensorFlow)."""
    from shardrec.orchestrator.checkpoints import find_checkpoints, table_rows

    arrays = table_rows(find_checkpoints(os.path.join(directory, name))[0], table)
    order = np.argsort(arrays["keys"])
    pending = np.argsort(arrays["pending_keys"]) if "pending_keys" in arrays else None
    return {k: v[pending] if k.startswith("pending") else v[order] for k, v in arrays.items()}


def assert_rows_equal(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def assert_saved_again(got, want, step):
    """Step `step` of supervised_train.py saved again by the ranks that restored it (the saver hook
    saves at session start) holds every restored row, slots and counts bitwise; it may also hold keys
    that batches after `step`, read ahead by then, added at their initial rows: those have no
    optimizer state yet."""
    import sys

    from mpi_helpers import JOBS

    if JOBS not in sys.path:
        sys.path.insert(0, JOBS)
    from supervised_train import global_batches

    assert sorted(got) == sorted(want)
    at = np.minimum(np.searchsorted(got["keys"], want["keys"]), len(got["keys"]) - 1)
    assert np.array_equal(got["keys"][at], want["keys"]), np.setdiff1d(want["keys"], got["keys"])[:10]
    for name in want:
        if name.startswith("pending"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        elif name != "keys":
            np.testing.assert_array_equal(got[name][at], want[name], err_msg=name)
    extra = np.setdiff1d(got["keys"], want["keys"])
    assert np.isin(extra, global_batches()[0][step:]).all(), extra  # ids of later batches only
    new = np.isin(got["keys"], extra)
    for name in got:
        if "." in name:  # an optimizer's slot (values and keys have no dot)
            assert not got[name][new].any(), (name, extra)


def started(run, attempt):
    """(np, hosts, resumed_from) of an attempt, from its command.json."""
    with open(run / f"attempt-{attempt}" / "command.json") as f:
        c = json.load(f)
    return c["np"], c["hosts"], c["resume_from"]


def beat_step(run, attempt, rank=0):
    try:
        with open(run / f"attempt-{attempt}" / "heartbeat" / f"rank-{rank}.json") as f:
            return json.load(f).get("step") or 0
    except (OSError, ValueError):
        return 0


def by_hand(tmp, name, source, step, ranks, stop, env=None):
    """The supervisor's test job run by hand on `ranks` from checkpoint `step` of the directory
    `source` (copied) up to step `stop`: what a user restarting on those ranks gets. Returns (its
    checkpoint directory, its output directory)."""
    ckpt, out = tmp / f"{name}-ckpt", tmp / f"{name}-out"
    ckpt.mkdir()
    out.mkdir()
    prefix = f"model.ckpt-{step}"
    for entry in os.listdir(source):
        if entry.startswith(prefix + ".") or entry == f"sparse-{prefix}":
            copy = shutil.copytree if os.path.isdir(source / entry) else shutil.copy
            copy(source / entry, ckpt / entry)
    (ckpt / "checkpoint").write_text(f'model_checkpoint_path: "{prefix}"\nall_model_checkpoint_paths: "{prefix}"\n')
    if env and "SSD_DIR" in env:
        env = dict(env, SSD_DIR=str(tmp / f"{name}-ssd"))
        os.mkdir(env["SSD_DIR"])
    check(mpiexec(ranks, "supervised_train.py", ckpt, out, env={"STOP_AT": str(stop), **(env or {})}, timeout=300))
    return ckpt, out


def assert_same_training(elastic_ckpt, tmp, restored, grown_at, out, env=None, ranks=(1, 2)):
    """The elastic job, segment by segment, against a user restarting by hand from the same
    checkpoints: `ranks` (fewer, more). The fewer from `restored` to `grown_at` (the same dense
    variables, bitwise, and the same rows of every key the job's checkpoint holds: a run stopped by
    its step hook also saves the keys its prefetched batches added, with their initial rows), then
    the more from the job's checkpoint of `grown_at` to the end (everything bitwise)."""
    import tensorflow as tf

    fewer, more = ranks
    hand_ckpt, _ = by_hand(tmp, "hand-1", elastic_ckpt, restored, fewer, grown_at, env)
    name = f"model.ckpt-{grown_at}"
    np.testing.assert_array_equal(tf.train.load_variable(str(hand_ckpt / name), "w"),
                                  tf.train.load_variable(str(elastic_ckpt / name), "w"))
    got, want = rows_of(elastic_ckpt, name), rows_of(hand_ckpt, name)
    at = np.minimum(np.searchsorted(want["keys"], got["keys"]), len(want["keys"]) - 1)
    lacking = got["keys"][want["keys"][at] != got["keys"]]
    assert not len(lacking), f"keys of the job's checkpoint that the user's lacks: {lacking[:10]}"
    for what in got:
        if what.startswith("pending"):  # keys still counting, in key order (rows_of)
            np.testing.assert_array_equal(got[what], want[what], err_msg=what)
        else:
            np.testing.assert_array_equal(got[what], want[what][at], err_msg=what)
    _, hand_out = by_hand(tmp, "hand-2", elastic_ckpt, grown_at, more, 30, env)
    assert_bitwise_same(out, hand_out, range(more))


def assert_bitwise_same(out, reference, ranks=(0, 1)):
    for rank in ranks:
        got, want = np.load(out / f"final-rank{rank}.npz"), np.load(reference / f"final-rank{rank}.npz")
        assert int(got["step"]) == int(want["step"])
        np.testing.assert_array_equal(got["w"], want["w"])
        order_got, order_want = np.argsort(got["keys"]), np.argsort(want["keys"])
        np.testing.assert_array_equal(got["keys"][order_got], want["keys"][order_want])
        np.testing.assert_array_equal(got["rows"][order_got], want["rows"][order_want], err_msg=f"rank {rank}")


def discovery(tmp, text):
    """A discovery script printing the file `hosts` (which the test rewrites), and that file."""
    listing = tmp / "hosts"
    listing.write_text(text)
    script = tmp / "discover.sh"
    script.write_text(f"#!/bin/sh\nmode=$(cat {tmp}/mode 2>/dev/null)\n"
                      'case "$mode" in fail) echo "inventory down" >&2; exit 3;; hang) sleep 60;; '
                      'garbage) echo "not a host!";; esac\n'
                      f"cat {listing}\n")
    script.chmod(0o755)
    return script, listing


def elastic_args(script, *extra):
    return ("--host-discovery-script", script, "--min-np", 1, "--max-np", 2, "--blacklist-cooldown-range", 1, 5,
            *extra)


@contextlib.contextmanager
def stopped_at_the_end(proc):
    """The supervisor of a test that failed half way is killed, not left running."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
