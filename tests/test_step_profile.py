"""row_exchange_share against hand-computed spans: overlapping all-to-alls count once."""
import pytest
import tensorflow as tf

from shardrec.rank_runtime.step_profile import row_exchange_share


def _metadata(nodes):
    md = tf.compat.v1.RunMetadata()
    dev = md.step_stats.dev_stats.add(device="/cpu:0")
    for name, start, length in nodes:
        dev.node_stats.add(node_name=name, all_start_micros=start, all_end_rel_micros=length)
    return md


def test_share_counts_the_union_of_overlapping_exchanges():
    graph = tf.Graph()
    with graph.as_default():
        for name in ("a2a_fwd", "a2a_bwd"):
            tf.raw_ops.NoOp(name=name)
    # Step spans [100, 300); the exchanges cover [120, 160) u [150, 170) u [200, 210) = 60 us.
    md = _metadata([("matmul", 100, 50), ("a2a_fwd", 120, 40), ("a2a_bwd", 150, 20), ("a2a_fwd", 200, 10),
                    ("apply", 250, 50)])
    # NoOps stand in for ShardrecRowAlltoall ops; "matmul" and "apply" are not in the graph's exchange ops.
    assert row_exchange_share(md, graph, op_type="NoOp") == pytest.approx(60 / 200)
    assert row_exchange_share(md, graph) == 0


def test_share_needs_a_traced_step():
    with pytest.raises(ValueError, match="traced_run_options"):
        row_exchange_share(tf.compat.v1.RunMetadata(), tf.Graph())
