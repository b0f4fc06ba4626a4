"""The op library's row gathers against plain TensorFlow on the same inputs: values, gradients
(repeated indices summed), both index types, and bad indices refused with the position named."""
import numpy as np
import pytest
import tensorflow as tf

from shardrec.rank_runtime.embedding import native_ops

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64])
def test_row_gather_and_its_gradient_equal_tensorflow_s(graph, index_dtype):
    rng = np.random.default_rng(4)
    rows_value = rng.normal(size=(50, 7)).astype(np.float32)
    index_value = rng.integers(0, 50, size=300)  # many repeats: their gradients must add up
    weights = rng.normal(size=(300, 7)).astype(np.float32)
    rows = tf.constant(rows_value)
    index = tf.constant(index_value, index_dtype)
    ours = native_ops.row_gather(rows, index)
    theirs = tf.gather(rows, index)
    grad_ours = tf.gradients(tf.reduce_sum(ours * weights), rows)[0]
    grad_theirs = tf.convert_to_tensor(tf.gradients(tf.reduce_sum(theirs * weights), rows)[0])
    assert ours.shape.as_list() == [300, 7]
    with tf.compat.v1.Session() as sess:
        a, b, ga, gb = sess.run([ours, theirs, grad_ours, grad_theirs])
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(ga, gb, rtol=1e-6, atol=1e-6)
    assert np.abs(ga).sum() > 0


def test_variable_row_gather_reads_the_rows_of_the_table(graph):
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    var = tf.compat.v1.get_variable("t", initializer=table, use_resource=True)
    got = native_ops.variable_row_gather(var, tf.constant([9, 0, 3, 3]))
    outside = native_ops.variable_row_gather(var, tf.constant([1, 10]))
    with tf.compat.v1.Session() as sess:
        sess.run(var.initializer)
        np.testing.assert_array_equal(sess.run(got), table[[9, 0, 3, 3]])
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"row 10 at 1 is outside the table's 10 rows"):
            sess.run(outside)


@pytest.mark.parametrize("table_dtype", [tf.float32, tf.float16])
def test_the_expanded_gather_reads_as_two_gathers_and_sums_its_gradient_per_distinct_row(graph, table_dtype):
    """table[rows[expand]] in one pass, as TensorFlow's two gathers; its gradient is IndexedSlices
    over `rows` itself (distinct rows), each the sum of the weights of the positions that read it
    (numpy's add.at of them)."""
    rng = np.random.default_rng(7)
    table = rng.normal(size=(60, 16)).astype(table_dtype.as_numpy_dtype)
    rows_value = rng.permutation(60)[:25].astype(np.int32)
    expand_value = rng.integers(0, 25, size=90).astype(np.int32)  # repeats: their gradients add up
    weights = rng.normal(size=(90, 16)).astype(np.float32)
    var = tf.compat.v1.get_variable("t", initializer=table, use_resource=True)
    rows, expand = tf.constant(rows_value), tf.constant(expand_value)
    ours = native_ops.variable_row_gather(var, rows, expand=expand)
    theirs = tf.gather(tf.gather(tf.cast(var, tf.float32), rows), expand)
    grad_ours = tf.gradients(tf.reduce_sum(ours * weights), var)[0]
    bad = native_ops.variable_row_gather(var, rows, expand=tf.constant([0, 25], tf.int32))
    assert ours.shape.as_list() == [90, 16]
    assert isinstance(grad_ours, tf.IndexedSlices) and grad_ours.indices is rows
    with tf.compat.v1.Session() as sess:
        sess.run(var.initializer)
        a, b, ga = sess.run([ours, theirs, grad_ours])
        np.testing.assert_array_equal(a, table.astype(np.float32)[rows_value[expand_value]])
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ga.indices, rows_value)
        dense, expected = np.zeros((60, 16), np.float32), np.zeros((60, 16), np.float32)
        dense[ga.indices] = ga.values
        np.add.at(expected, rows_value[expand_value], weights)
        np.testing.assert_allclose(dense, expected, rtol=1e-5, atol=1e-5)
        assert np.abs(dense).sum() > 0
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"expand 25 at 1 is outside the index's 25 rows"):
            sess.run(bad)


def test_a_gather_index_outside_the_rows_is_refused(graph):
    rows = tf.zeros([5, 2])
    with tf.compat.v1.Session() as sess:
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"index -1 at 2 is outside the 5 rows"):
            sess.run(native_ops.row_gather(rows, tf.constant([0, 4, -1])))
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"index 5 at 0 is outside the 5 rows"):
            sess.run(native_ops.load().shardrec_row_gather_grad(tf.ones([1, 2]), tf.constant([5]), 5))


def test_tables_and_their_slots_are_placed_in_host_memory(runtime):
    """The op library's table kernels are CPU kernels: a table (and the slots its optimizer makes
    next to it) is pinned to the host, whatever devices TensorFlow sees."""
    from mx_rec.optimizers import lazy_adam
    from shardrec.rank_runtime import create_table

    table = create_table(tf.int64, 4, "placed", tf.compat.v1.zeros_initializer(), device_vocabulary_size=10)
    assert table.variable.device.endswith("device:CPU:0"), table.variable.device
    grad = tf.IndexedSlices(tf.ones([2, 4]), tf.constant([0, 1]), tf.constant([11, 4]))
    lazy_adam.create_hash_optimizer(0.1).apply_gradients([(grad, table.variable)])
    assert table.slots and all(s.device.endswith("device:CPU:0") for s in table.slots.values()), \
        {n: s.device for n, s in table.slots.items()}


def test_a_row_exchange_without_a_communicator_says_to_start_the_pipeline(graph):
    op = native_ops.row_alltoall(tf.zeros([2, 3]), tf.constant([2], tf.int32), tf.constant([2], tf.int32),
                                 "never/made/train#0", 5.0)
    with tf.compat.v1.Session() as sess:
        with pytest.raises(tf.errors.FailedPreconditionError, match=r"row exchange 'never/made/train#0' has no "
                                                                    r"communicator in this process: start the key "
                                                                    r"pipeline \(start_asc_pipeline\(\)"):
            sess.run(op)


def test_row_exchange_on_one_rank_returns_the_rows_and_its_gradient_sends_them_back(runtime):
    from shardrec.rank_runtime.formats.channel import Channel, RowExchangeName
    from shardrec.rank_runtime.process.world import get_world

    exchange = RowExchangeName("unit", "f", Channel.TRAIN, 0)
    assert (exchange.rows, exchange.gradients) == ("unit/f/train#0", "unit/f/train#0 gradients")
    get_world().make_row_exchanges([exchange])
    rows = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3))
    four = tf.constant([4], tf.int32)
    out = native_ops.row_alltoall(rows, four, four, exchange.rows, 5.0, exchange.gradients)
    grad = tf.gradients(tf.reduce_sum(out * 2.0), rows)[0]
    with tf.compat.v1.Session() as sess:
        got, got_grad = sess.run([out, grad])
    np.testing.assert_array_equal(got, np.arange(12).reshape(4, 3))
    np.testing.assert_array_equal(got_grad, np.full((4, 3), 2.0))
