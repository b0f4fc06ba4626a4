"""The models of tests/mpi_jobs/incremental_job.py (dim 4) and every_row_job.py (dim 8) as served:
the table's rows ("emb"), the dense weight ("w") and a prediction from both ("score");
shardrec-export's --model-fn in tests/test_live_serving.py."""
import tensorflow as tf

from shardrec.rank_runtime import create_table, sparse_lookup


def outputs(features, dim=4):
    table = create_table(tf.int64, dim, "emb", tf.compat.v1.zeros_initializer())
    w = tf.compat.v1.get_variable("w", [dim])
    emb = sparse_lookup(table, features["ids"], modify_graph=True)
    return {"emb": emb, "score": tf.reduce_sum(emb * w, axis=-1), "w": tf.identity(w)}


def every_row_outputs(features):
    """Every output one row per id (w repeated on each), so that shardrec-serve --enable-batching
    runs concurrent requests together."""
    out = outputs(features, dim=8)
    return dict(out, w=tf.tile(out["w"][None], [tf.size(features["ids"]), 1]))


def scaled_outputs(features):
    """Two batched inputs: the score of each id times its own scale."""
    out = outputs(features)
    return dict(out, score=out["score"] * features["scale"])


def batched_outputs(features):
    """The rows and the score only: every output one row per id (a batched signature)."""
    out = outputs(features)
    return {"emb": out["emb"], "score": out["score"]}
