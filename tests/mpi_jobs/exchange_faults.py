"""Faults of the key exchange under real mpiexec, one per MODE (first argument):

    caught_overflow  static shapes; rank 1's third batch overflows send_count; every rank catches
                     the error and goes on training: each prints how its steps went
    full_table       rank 1's third batch fills rank 0's shard; every rank catches and goes on
    order            rank 0 lists FeatureSpecs [a, b], rank 1 [b, a]; prints the keys each table holds
    dim_mismatch     table 'tb' has dim 4 on rank 0 and dim 8 on rank 1
    eval_one_rank    both ranks train, then rank 0 alone evaluates (short exchange timeout)
    exit_status      rank 1 calls sys.exit(3) while rank 0 trains on
    step_one_rank    both ranks' pipelines run, but only rank 0 runs a training step (short timeout)
    raise_before_init  rank 1 raises after importing mx_rec, before init() and before MPI started
    exit_before_init   likewise, rank 1 calls sys.exit(5) instead
    raise_before_slow_init  rank 1 raises before MPI started; rank 0 waits for a signal before init()
    mpi_raise_before_init  the same after the script started MPI itself (mpi4py, to read its rank): the
                     FileNotFoundError of a wrong data path on one host
    mpi_exit_before_init   likewise, rank 1 calls sys.exit(4) instead
    eval_after_exit  every rank trains; rank 1 exits, the others run an evaluation pass
                     (run it on 2 or 3 ranks)
    empty_rank       rank 1's dataset is empty
    stop_early       both ranks run 3 of 40 steps and exit; rank 0's prefetch runs on for 3 s first
    stop_and_resume  as stop_early (1 s), then a second session of the same graph trains the whole pass
    extra_lookup     rank 1 looks its feature up twice, rank 0 once
    row_splits_disagree  a row exchange whose splits the ranks disagree on: rank 0 sends rank 1 two rows
                     where it expects one, rank 1 sends rank 0 one where it expects two
Lines the tests read: RESULT rank=<r> ..., ERROR rank=<r>: <message>, HELD rank=<r> table=<t> keys=<k,...>.
"""
import os
import sys
import time

import numpy as np
import tensorflow as tf

import mx_rec.core.embedding  # noqa: F401 - what a Rec SDK script imports first
from mx_rec.optimizers import lazy_adam
from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable, get_rank_id,
                                   get_rank_size, init, sparse_lookup, start_asc_pipeline)

MODE = sys.argv[1]


def all_said(name, ranks, rank, seconds=60):
    """Waits until every rank of `ranks` reached this point: each leaves a file in the test's
    RENDEZVOUS_DIR, and the ranks can no longer meet in a collective (a peer has left)."""
    folder = os.environ["RENDEZVOUS_DIR"]
    open(os.path.join(folder, f"{name}-{rank}"), "w").close()
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(os.path.join(folder, f"{name}-{r}")) for r in ranks):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank(s) {ranks} did not all reach {name} within {seconds} s")
        time.sleep(0.05)


def say(text):
    print(text, flush=True)


def first_line(error):
    message = error.message if isinstance(error, tf.errors.OpError) else str(error)
    return next((line for line in message.splitlines() if "rank" in line and "Traceback" not in line), message)


def train_graph(ids_by_feature, dims, tables, batch, send_count=None, is_training=True, prefetch=2):
    """A dataset of the given id arrays, one lookup per feature, a loss and lazy Adam."""
    specs = [FeatureSpec(name, table_name=tables[name]) for name in ids_by_feature]
    dataset = tf.data.Dataset.from_tensor_slices(ids_by_feature).batch(batch, drop_remainder=True)
    dataset = dataset.map(get_asc_insert_func(specs, is_training=is_training)).prefetch(prefetch)
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    element = iterator.get_next()
    made = {}
    for name in sorted(set(tables.values())):
        made[name] = create_table(tf.int64, dims[name], name, tf.compat.v1.constant_initializer(0.1),
                                  device_vocabulary_size=dims.get("vocab", 1000))
    outs = [sparse_lookup(made[tables[s.name]], s, send_count, batch=element, is_train=is_training) for s in specs]
    loss = tf.add_n([tf.reduce_sum(tf.square(o - 1.0)) for o in outs])
    return iterator, loss, made


def train_op(loss):
    _, sparse = get_dense_and_sparse_variable()
    grads = tf.gradients(loss, sparse)
    return lazy_adam.create_hash_optimizer(0.05).apply_gradients(zip(grads, sparse))


def run_catching(sess, iterator, fetch, rank):
    sess.run(iterator.initializer)
    ok, errors, first = 0, 0, None
    while True:
        try:
            sess.run(fetch)
            ok += 1
        except tf.errors.OutOfRangeError:
            break
        except tf.errors.OpError as e:
            if first is None:
                first = ok + errors
                say(f"ERROR rank={rank}: {first_line(e)}")
            errors += 1
    say(f"RESULT rank={rank} ok={ok} errors={errors} first_error_batch={first}")


def caught(use_dynamic, make_ids, vocab, send_count=None):
    init(use_dynamic=use_dynamic)
    rank = get_rank_id()
    ids = make_ids(rank)
    iterator, loss, _ = train_graph({"ids": ids}, {"t": 4, "vocab": vocab}, {"ids": "t"}, 8, send_count)
    step = train_op(loss)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        run_catching(sess, iterator, step, rank)


def overflow_ids(rank):
    ids = np.tile(np.arange(4, dtype=np.int64), (48, 1))[:, :2]  # two distinct keys per batch
    if rank == 1:
        ids[16:24] = np.arange(0, 32, 2).reshape(8, 2)  # batch 2: 16 keys for rank 0
    return ids


def full_table_ids(rank):
    ids = np.zeros((48, 2), np.int64) + rank
    if rank == 1:
        ids[16:24] = np.arange(100, 132, 2).reshape(8, 2)  # batch 2: 16 new keys for rank 0
    return ids


def order():
    init()
    rank = get_rank_id()
    rng = np.random.default_rng(rank)
    data = {"a": rng.integers(0, 50, size=(32, 2)), "b": rng.integers(1000, 1050, size=(32, 3))}
    names = ["a", "b"] if rank == 0 else ["b", "a"]
    specs = [FeatureSpec(n, table_name=f"t{n}") for n in names]
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(8).map(get_asc_insert_func(specs))
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    batch = iterator.get_next()
    tables = {n: create_table(tf.int64, 4, f"t{n}", tf.compat.v1.constant_initializer(0.1),
                              device_vocabulary_size=1000) for n in ("a", "b")}
    loss = tf.add_n([tf.reduce_sum(sparse_lookup(tables[s.name], s, batch=batch)) for s in specs])
    step = train_op(loss)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        run_catching(sess, iterator, step, rank)
    for n, table in tables.items():
        keys, _ = table.index.export()
        say(f"HELD rank={rank} table=t{n} keys={','.join(map(str, sorted(keys.tolist())))}")


def dim_mismatch():
    init()
    rank = get_rank_id()
    data = {"a": np.arange(32).reshape(16, 2), "b": np.arange(32).reshape(16, 2)}
    iterator, loss, _ = train_graph(data, {"ta": 4, "tb": 4 if rank == 0 else 8}, {"a": "ta", "b": "tb"}, 4)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        run_catching(sess, iterator, loss, rank)


def exit_status():
    init()
    rank = get_rank_id()
    ids = np.arange(6400).reshape(3200, 2)
    iterator, loss, _ = train_graph({"ids": ids}, {"t": 4, "vocab": 10000}, {"ids": "t"}, 8)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(iterator.initializer)
        sess.run(loss)
        if rank == 1:
            say("RESULT rank=1 exiting with 3")
            sys.exit(3)
        while True:
            sess.run(loss)


def one_rank_only(is_training):
    """Both ranks build the same pipeline; only rank 0 runs the step (train: after one step that
    both run, so the key exchange has already moved the batch and the wait is in Horovod)."""
    init()
    rank = get_rank_id()
    ids = np.arange(64).reshape(32, 2)
    iterator, loss, _ = train_graph({"ids": ids}, {"t": 4}, {"ids": "t"}, 8, is_training=is_training)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(iterator.initializer)
        if is_training:
            sess.run(loss)
        if rank == 0:
            started = time.monotonic()
            try:
                sess.run(loss)
            except tf.errors.OpError as e:
                say(f"ERROR rank={rank}: {first_line(e)}")
                say(f"RESULT rank={rank} waited={time.monotonic() - started:.1f}")
                raise
        else:
            say(f"RESULT rank={rank} skipped the {'step' if is_training else 'evaluation'}")
            time.sleep(120)  # alive, just not taking part


def empty_rank():
    init()
    rank = get_rank_id()
    ids = np.arange(64).reshape(32, 2)[: 0 if rank == 1 else 32]
    iterator, loss, _ = train_graph({"ids": ids}, {"t": 4}, {"ids": "t"}, 8)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        run_catching(sess, iterator, loss, rank)


def stop_after_three_steps(fetch, hold_s):
    """A session of the step-limited graph (prefetch 8) that runs 3 of its 40 batches; rank 0's
    prefetch runs on for `hold_s` before it closes, rank 1 closes at once."""
    init()
    rank = get_rank_id()
    ids = np.arange(640).reshape(320, 2)
    iterator, loss, _ = train_graph({"ids": ids}, {"t": 4}, {"ids": "t"}, 8, prefetch=8)
    fetch = train_op(loss) if fetch == "step" else loss
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(iterator.initializer)
        for _ in range(3):
            sess.run(fetch)
        if rank == 0:
            time.sleep(hold_s)
    return rank, iterator, fetch


def stop_early():
    """A script that stops before its data ends (max_steps): rank 1 closes its session at once, rank
    0's prefetch goes on exchanging batches for 3 s first, so its pipeline waits in a round that
    rank 1 never begins; rank 1's close must end that round."""
    rank, _, _ = stop_after_three_steps("loss", 3)
    say(f"RESULT rank={rank} closed")


def stop_and_resume():
    """Two sessions of one graph: the first stops after 3 steps with the ranks' prefetches at
    different rounds (rank 0's runs on for 1 s), the second trains the whole pass. The first's
    close words (pass_closing.h) must neither end nor shift the second's rounds."""
    rank, iterator, step = stop_after_three_steps("step", 1)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        run_catching(sess, iterator, step, rank)


def eval_after_exit():
    """Every rank trains; rank 1 then exits (evaluation left to the others, the classic mistake) and
    the ranks still in the job run an evaluation pass, which must fail on each of them."""
    init()
    rank = get_rank_id()
    ids = np.arange(64).reshape(32, 2) + 100 * rank
    iterator, loss, tables = train_graph({"ids": ids}, {"t": 4}, {"ids": "t"}, 8)
    step = train_op(loss)
    spec = FeatureSpec("eval_ids", table_name="t")
    evaluation = tf.data.Dataset.from_tensor_slices({"eval_ids": ids}).batch(8)
    eval_iterator = tf.compat.v1.data.make_initializable_iterator(
        evaluation.map(get_asc_insert_func([spec], is_training=False)))
    emb = sparse_lookup(tables["t"], spec, batch=eval_iterator.get_next(), is_train=False)
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        run_catching(sess, iterator, step, rank)
        if rank == 1:
            return
        sess.run(eval_iterator.initializer)
        batches = 0
        try:
            while True:
                sess.run(emb)
                batches += 1
        except tf.errors.OutOfRangeError:
            say(f"RESULT rank={rank} evaluated {batches} batches")
        except tf.errors.OpError as e:
            say(f"ERROR rank={rank}: {first_line(e)}")
            # The other evaluating ranks print their own before this one's error ends the job.
            all_said("eval-error", [r for r in range(get_rank_size()) if r != 1], rank)
            raise


def extra_lookup():
    """The ranks build different lookups: both must stop at start_asc_pipeline, naming the difference."""
    init()
    rank = get_rank_id()
    spec = FeatureSpec("ids", table_name="t")
    dataset = tf.data.Dataset.from_tensor_slices({"ids": np.arange(64).reshape(32, 2)}).batch(8)
    element = tf.compat.v1.data.make_one_shot_iterator(dataset.map(get_asc_insert_func([spec]))).get_next()
    table = create_table(tf.int64, 4, "t", tf.compat.v1.constant_initializer(0.1), device_vocabulary_size=100)
    for _ in range(1 + rank):
        sparse_lookup(table, spec, batch=element)
    try:
        start_asc_pipeline()
    except ValueError as e:
        say(f"ERROR rank={rank}: {e}")
        sys.exit(3)


def row_splits_disagree():
    from shardrec.rank_runtime.embedding import native_ops
    from shardrec.rank_runtime.formats.channel import Channel, RowExchangeName
    from shardrec.rank_runtime.process.world import get_world

    init()
    rank = get_rank_id()
    exchange = RowExchangeName("t", "ids", Channel.TRAIN, 0)
    get_world().make_row_exchanges([exchange])
    send, recv = ([1, 2], [1, 2]) if rank == 0 else ([1, 1], [1, 1])
    rows = tf.constant(np.ones([sum(send), 2], np.float32))
    out = native_ops.row_alltoall(rows, tf.constant(send, tf.int32), tf.constant(recv, tf.int32), exchange.rows, 10.0)
    with tf.compat.v1.Session() as sess:
        try:
            sess.run(out)
            say(f"RESULT rank={rank} exchanged")
        except tf.errors.OpError as e:
            say(f"ERROR rank={rank}: " + next(line for line in e.message.splitlines() if "row exchange" in line))


if __name__ == "__main__":
    tf.compat.v1.disable_eager_execution()
    if MODE == "caught_overflow":
        caught(False, overflow_ids, 1000, send_count=4)
    elif MODE == "full_table":
        caught(True, full_table_ids, 20)
    elif MODE in ("raise_before_init", "exit_before_init", "raise_before_slow_init"):
        if int(os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == 1:
            if MODE == "exit_before_init":
                sys.exit(5)
            raise RuntimeError("rank 1 fails before init()")
        if MODE == "raise_before_slow_init":
            __import__("signal").pause()  # busy before init() until mpiexec ends the job
        init()
        say("RESULT rank=0 initialised")
        get_world = __import__("shardrec.rank_runtime.process.world", fromlist=["get_world"]).get_world
        get_world().sum_over_ranks(1, "waiting for rank 1", timeout=100)
    elif MODE in ("mpi_raise_before_init", "mpi_exit_before_init"):
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 1:
            if MODE == "mpi_exit_before_init":
                sys.exit(4)
            open("/nonexistent/shardrec-test-data.csv")
        init()
        say("RESULT rank=0 initialised")
        get_world = __import__("shardrec.rank_runtime.process.world", fromlist=["get_world"]).get_world
        get_world().sum_over_ranks(1, "waiting for rank 1", timeout=100)
    elif MODE in ("eval_one_rank", "step_one_rank"):
        one_rank_only(is_training=MODE == "step_one_rank")
    else:
        globals()[MODE]()
