"""Static shapes with a send_count that rank 1's batches overflow: every rank must raise the
named error, and the job must end non-zero."""
import numpy as np
import tensorflow as tf
from mpi4py import MPI

from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_rank_id, init, sparse_lookup,
                          start_asc_pipeline)

if __name__ == "__main__":
    tf.compat.v1.disable_eager_execution()
    init(use_dynamic=False)
    rank = get_rank_id()
    # Rank 0 repeats one key; rank 1 sends 16 distinct even keys, all owned by rank 0.
    ids = np.zeros((32, 2), np.int64) if rank == 0 else np.arange(0, 128, 2).reshape(32, 2)
    spec = FeatureSpec("ids", table_name="narrow")
    dataset = tf.data.Dataset.from_tensor_slices({"ids": ids}).batch(8, drop_remainder=True).map(
        get_asc_insert_func([spec], is_training=True))
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    table = create_table(tf.int64, 4, "narrow", tf.compat.v1.ones_initializer(), device_vocabulary_size=1000)
    out = sparse_lookup(table, spec, 4, batch=iterator.get_next())
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(iterator.initializer)
        try:
            sess.run(out)
        except tf.errors.OpError as e:
            line = next(x for x in e.message.splitlines() if "send_count=" in x)
            print(f"ERROR rank={rank}: {line}", flush=True)
            MPI.COMM_WORLD.Barrier()  # both ranks have printed before the abort below ends the job
            raise
    print(f"NO ERROR rank={rank}", flush=True)
