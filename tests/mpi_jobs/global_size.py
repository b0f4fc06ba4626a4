"""global_size() sums over the ranks; a lone caller gets a TimeoutError instead of a hang."""
import numpy as np
import tensorflow as tf

from shardrec.rank_runtime import FeatureSpec, create_table, get_asc_insert_func, get_rank_id, init, sparse_lookup
from shardrec.rank_runtime import start_asc_pipeline, terminate_config_initializer

if __name__ == "__main__":
    tf.compat.v1.disable_eager_execution()
    init()
    rank = get_rank_id()
    spec = FeatureSpec("ids", table_name="t")
    ids = np.arange(40).reshape(20, 2) + 1000 * rank   # 40 distinct keys per rank, none shared
    dataset = tf.data.Dataset.from_tensor_slices({"ids": ids}).batch(5).map(get_asc_insert_func([spec]))
    iterator = tf.compat.v1.data.make_initializable_iterator(dataset)
    table = create_table(tf.int64, 2, "t", tf.compat.v1.zeros_initializer(), device_vocabulary_size=1000)
    out = sparse_lookup(table, spec, batch=iterator.get_next())
    start_asc_pipeline()
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(iterator.initializer)
        while True:
            try:
                sess.run(out)
            except tf.errors.OutOfRangeError:
                break
    print(f"SIZES rank={rank} local={table.size()} global={table.global_size()}", flush=True)
    if rank == 1:
        try:
            table.global_size(timeout=2)
        except TimeoutError as e:
            print(f"LONE rank={rank}: {e}", flush=True)
    terminate_config_initializer()
