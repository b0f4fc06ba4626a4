"""The same sparse step (lookup, forward, backward, sparse update) built by shardrec and by what
a user would use instead. Each builder takes a tf.data dataset of {"ids": [B, F] int64,
"rows": [B, F] int32 pre-mapped rows} and returns (train_op, setup(sess)).

The model is the same everywhere: loss = mean over the batch of (sum of the looked-up rows)^2.
"""
import numpy as np
import tensorflow as tf

LR = 0.001


def _loss(emb):
    return tf.reduce_mean(tf.square(tf.reduce_sum(emb, axis=[1, 2])))


def lazy_adam_update(var, m, v, indices, grad, step, lr=LR, b1=0.9, b2=0.999, eps=1e-8):
    """Lazy Adam with scatter ops on unique `indices` (TensorFlow's v1 Adam is not lazy)."""
    t = tf.cast(step, tf.float32)
    lr_t = lr * tf.sqrt(1 - b2**t) / (1 - b1**t)
    m_rows = b1 * tf.gather(m, indices) + (1 - b1) * grad
    v_rows = b2 * tf.gather(v, indices) + (1 - b2) * tf.square(grad)
    return tf.group(_update(m.scatter_update(tf.IndexedSlices(m_rows, indices))),
                    _update(v.scatter_update(tf.IndexedSlices(v_rows, indices))),
                    _update(var.scatter_sub(tf.IndexedSlices(lr_t * m_rows / (tf.sqrt(v_rows) + eps), indices))))


def _update(result):
    """The update op of a resource variable's scatter_*: what it returns is a read of the whole
    variable, and running that copies the table every step (6.5 of a 16.7 ms SGD step, measured
    with bench/op_profile.py), which no TensorFlow user's train op does."""
    return result.op


def _embed(var, unique, restore, shape):
    rows = tf.gather(var, unique)
    return rows, tf.reshape(tf.gather(rows, restore), tf.concat([shape, [var.shape[1]]], 0))


def _unique_rows_step(var, slots_var, unique, restore, shape, optimizer, step):
    """Gather the distinct rows once, expand them to the batch, update them lazily."""
    rows, emb = _embed(var, unique, restore, shape)
    grad = tf.convert_to_tensor(tf.gradients(_loss(emb), rows)[0])
    if optimizer == "sgd":
        return _update(var.scatter_sub(tf.IndexedSlices(LR * grad, unique)))
    m, v = slots_var
    return lazy_adam_update(var, m, v, unique, grad, step)


def _sgd_step(var, rows_idx):
    """Plain TensorFlow's SGD needs no dedup: the gather's gradient goes to a scatter-sub, which
    adds the gradients of repeated rows."""
    emb = tf.gather(var, rows_idx)
    grad = tf.gradients(_loss(emb), var)[0]
    return _update(var.scatter_sub(tf.IndexedSlices(LR * grad.values, grad.indices)))


def _variables(rows, dim, optimizer):
    init = tf.compat.v1.truncated_normal_initializer(stddev=0.05, seed=1)
    var = tf.compat.v1.get_variable("emb", [rows, dim], initializer=init, use_resource=True)
    slots = None
    if optimizer == "lazy_adam":
        slots = [tf.compat.v1.get_variable(n, [rows, dim], initializer=tf.zeros_initializer(), use_resource=True)
                 for n in ("m", "v")]
    return var, slots


def _premapped(dataset, dim, optimizer, capacity, dedup_in_dataset):
    if optimizer == "lazy_adam" and dedup_in_dataset:
        # What a careful TensorFlow user does: the dedup in the input pipeline, prefetched as
        # shardrec's key pipeline is (prefetch(4)), so it overlaps the step.
        def dedup(batch):
            unique, restore = tf.unique(tf.reshape(batch["rows"], [-1]))
            return dict(batch, unique=unique, restore=restore)

        dataset = dataset.map(dedup).prefetch(4)
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    var, slots = _variables(capacity, dim, optimizer)
    step = tf.compat.v1.train.get_or_create_global_step()
    with tf.control_dependencies([step.assign_add(1)]):
        if optimizer == "sgd":
            return _sgd_step(var, batch["rows"]), lambda sess: None
        if dedup_in_dataset:
            unique, restore = batch["unique"], batch["restore"]
        else:
            unique, restore = tf.unique(tf.reshape(batch["rows"], [-1]))
        op = _unique_rows_step(var, slots, unique, restore, tf.shape(batch["rows"]), optimizer, step)
    return op, lambda sess: None


def tf_premapped(dataset, dim, optimizer, capacity):
    """TensorFlow's best case: ids already mapped to [0, V) outside the graph, no hashing at all;
    lazy Adam's dedup inside the step (SGD needs none)."""
    return _premapped(dataset, dim, optimizer, capacity, dedup_in_dataset=False)


def tf_premapped_ds(dataset, dim, optimizer, capacity):
    """As tf_premapped, with lazy Adam's dedup moved into the dataset and prefetched (for SGD the
    two are the same graph)."""
    return _premapped(dataset, dim, optimizer, capacity, dedup_in_dataset=True)


def tf_hash_table(dataset, dim, optimizer, capacity):
    """The porting baseline (seed 003): a DenseHashTable from key to row of a tf.Variable,
    inserting unseen keys at the next free row. One dedup, one lookup of the distinct keys; the
    table starts with room for `capacity` keys (no rehash while it fills)."""
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    buckets = 1 << max(4, int(np.ceil(np.log2(capacity / 0.8))))  # its default max load factor is 0.8
    table = tf.lookup.experimental.DenseHashTable(tf.int64, tf.int64, default_value=-1, empty_key=-(2**63),
                                                  deleted_key=-(2**63) + 1, initial_num_buckets=buckets)
    next_row = tf.compat.v1.get_variable("next_row", [], tf.int64, tf.zeros_initializer(), use_resource=True)
    unique_ids, restore = tf.unique(tf.reshape(batch["ids"], [-1]))
    found = table.lookup(unique_ids)
    is_new = found < 0
    new_ids = tf.boolean_mask(unique_ids, is_new)
    count = tf.cast(tf.size(new_ids), tf.int64)
    first = next_row.assign_add(count) - count
    new_rows = first + tf.range(count)
    insert = table.insert(new_ids, new_rows)
    with tf.control_dependencies([insert]):
        rows = tf.tensor_scatter_nd_update(found, tf.where(is_new), new_rows)
    var, slots = _variables(capacity, dim, optimizer)
    step = tf.compat.v1.train.get_or_create_global_step()
    with tf.control_dependencies([step.assign_add(1)]):
        op = _unique_rows_step(var, slots, tf.cast(rows, tf.int32), restore, tf.shape(batch["ids"]), optimizer, step)
    return op, lambda sess: None


def tfra(dataset, dim, optimizer, capacity):
    """TensorFlow Recommenders-Addons as its docs advise: dynamic_embedding with an initial
    capacity (init_size) like shardrec's, embedding_lookup_unique (its dedup API: each distinct id
    is looked up, trained and updated once), and its optimizer wrapper."""
    import tensorflow_recommenders_addons as tfra_lib

    de = tfra_lib.dynamic_embedding
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    params = de.get_variable("tfra_emb", key_dtype=tf.int64, value_dtype=tf.float32, dim=dim, init_size=capacity,
                             initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.05, seed=1))
    emb = de.embedding_lookup_unique(params, batch["ids"], name="tfra_lookup")
    base = (tf.compat.v1.train.GradientDescentOptimizer(LR) if optimizer == "sgd"
            else tf.compat.v1.train.AdamOptimizer(LR))
    opt = de.DynamicEmbeddingOptimizer(base)
    return opt.minimize(_loss(emb)), lambda sess: None


def tfra_horovod(dataset, dim, optimizer, capacity):
    """TFRA sharded over Horovod ranks the way its Horovod all-to-all embedding layer does it: dedup,
    send each id to rank id mod N, look up there, send the rows back. One rank per process."""
    import horovod.tensorflow as hvd
    import tensorflow_recommenders_addons as tfra_lib

    de = tfra_lib.dynamic_embedding
    size = hvd.size()
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    ids = tf.reshape(batch["ids"], [-1])
    unique, restore = tf.unique(ids)
    owner = tf.cast(tf.math.floormod(unique, size), tf.int32)
    order = tf.argsort(owner, stable=True)
    send_ids = tf.gather(unique, order)
    splits = tf.math.bincount(owner, minlength=size, maxlength=size)
    recv_ids, recv_splits = hvd.alltoall(send_ids, splits=splits)
    params = de.get_variable("tfra_emb", key_dtype=tf.int64, value_dtype=tf.float32, dim=dim,
                             init_size=capacity // size + 1,
                             initializer=tf.compat.v1.truncated_normal_initializer(stddev=0.05, seed=1))
    # recv_ids are distinct: each sender deduped, and each id has one owner.
    local = de.embedding_lookup(params, recv_ids, name="tfra_lookup")
    back, _ = hvd.alltoall(local, splits=recv_splits)
    rows = tf.scatter_nd(order[:, None], back, tf.stack([tf.size(unique), dim]))
    emb = tf.reshape(tf.gather(rows, restore), tf.concat([tf.shape(batch["ids"]), [dim]], 0))
    base = (tf.compat.v1.train.GradientDescentOptimizer(LR) if optimizer == "sgd"
            else tf.compat.v1.train.AdamOptimizer(LR))
    return de.DynamicEmbeddingOptimizer(base).minimize(_loss(emb)), lambda sess: None


def shardrec(dataset, dim, optimizer, capacity, faae=False, evict_every=100, prefetch=4, memory_fraction=None,
             ssd_path=None, sharding=None):
    """shardrec: the key pipeline in the dataset, sparse_lookup, a sparse optimizer. faae: feature
    admission (access_threshold 2) and eviction (keys unseen for 20 steps, every `evict_every`
    steps by EvictHook; 0: admission alone), the timestamps being the step numbers.
    memory_fraction: an SSD tier under `ssd_path` for every key, below a memory budget of that
    fraction of them (device and host vocabulary in halves)."""
    from mx_rec.core.feature_process import EvictHook
    from mx_rec.optimizers import gradient_descent, lazy_adam
    from shardrec.rank_runtime import (FeatureSpec, create_table, get_asc_insert_func, get_dense_and_sparse_variable,
                              get_rank_size, sparse_lookup, start_asc_pipeline)

    thresholds = {"access_threshold": 2, "eviction_threshold": 20} if faae else {}
    spec = FeatureSpec("ids", table_name="emb", **thresholds)
    specs = [spec, FeatureSpec("ts", is_timestamp=True)] if faae else [spec]
    dataset = dataset.map(get_asc_insert_func(specs, is_training=True)).prefetch(prefetch)
    batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
    tiers = dict(device_vocabulary_size=capacity)
    if memory_fraction:
        memory = max(2, int(capacity * memory_fraction))
        tiers = dict(device_vocabulary_size=memory // 2, host_vocabulary_size=memory - memory // 2,
                     ssd_vocabulary_size=capacity, ssd_data_path=[ssd_path])
    # sharding: a placement (docs/guide/sharding.md); column_wise over every rank, table_wise on rank 0.
    placed = {} if sharding is None else {"sharding": sharding, "sharding_rank": (
        list(range(get_rank_size())) if sharding == "column_wise" else 0 if sharding == "table_wise" else None)}
    table = create_table(tf.int64, dim, "emb", tf.compat.v1.truncated_normal_initializer(stddev=0.05, seed=1),
                         **tiers, **placed)
    emb = sparse_lookup(table, spec, batch=batch)
    _, sparse = get_dense_and_sparse_variable()
    opt = (gradient_descent.create_hash_optimizer(LR) if optimizer == "sgd"
           else lazy_adam.create_hash_optimizer(LR))
    op = opt.apply_gradients(zip(tf.gradients(_loss(emb), sparse), sparse))
    if not faae:
        return op, lambda sess: start_asc_pipeline()
    step = tf.compat.v1.train.get_or_create_global_step()
    op = tf.group(op, step.assign_add(1))
    hook = EvictHook(evict_enable=evict_every > 0, evict_step_interval=evict_every or None, evict_time_interval=None)
    hook.begin()

    def setup(sess):
        """Starts the pipeline and the hook; returns the step, which reports each global step to the
        hook as MonitoredSession would (so that evicted rows are freed)."""
        start_asc_pipeline()
        hook.after_create_session(sess, None)

        def run():
            _, global_step = sess.run([op, step])
            hook.after_run(None, tf.compat.v1.train.SessionRunValues(global_step, None, None))

        return run

    return op, setup


def _feed_only(column):
    def build(dataset, dim, optimizer, capacity):
        """The feed with no step: the batch parsed and summed, what every peer pays before its step
        (bench/premapped_bound.py subtracts it)."""
        batch = tf.compat.v1.data.make_one_shot_iterator(dataset).get_next()
        return tf.reduce_sum(batch[column]).op, lambda sess: None

    return build


# The features of a record each peer reads (the others read "ids"): TensorFlow's best case reads
# rows mapped outside the graph instead of keys.
FEATURES = {"tf_premapped": ("rows",), "tf_premapped_ds": ("rows",), "feed_rows": ("rows",)}

PEERS = {"shardrec": shardrec, "tf_hash_table": tf_hash_table, "tf_premapped": tf_premapped,
         "tf_premapped_ds": tf_premapped_ds, "tfra": tfra, "tfra_horovod": tfra_horovod,
         "feed_ids": _feed_only("ids"), "feed_rows": _feed_only("rows")}
