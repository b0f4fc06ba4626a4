"""Where a training step's time goes, read from a traced Session.run: the share of the step's
wall time during which a row all-to-all (the op library's ShardrecRowAlltoall) was running.

    md = tf.compat.v1.RunMetadata()
    sess.run(train_op, options=traced_run_options(), run_metadata=md)
    share = row_exchange_share(md, tf.compat.v1.get_default_graph())

The row all-to-alls of a step (forward rows, backward gradients, one pair per table) may overlap
each other and compute; the share counts the union of their intervals, so time in which two of
them run at once is counted once, and a wait for a slower rank counts as exchange time.
"""
import tensorflow as tf

ROW_EXCHANGE_OP = "ShardrecRowAlltoall"


def traced_run_options() -> tf.compat.v1.RunOptions:
    return tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)


def _union_length(intervals):
    total, end = 0, None
    for lo, hi in sorted(intervals):
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def row_exchange_share(run_metadata, graph: tf.Graph, op_type: str = ROW_EXCHANGE_OP) -> float:
    """Fraction in [0, 1] of the traced step's span spent with an `op_type` op in flight."""
    names = {op.name for op in graph.get_operations() if op.type == op_type}
    spans, exchange = [], []
    for device in run_metadata.step_stats.dev_stats:
        for node in device.node_stats:
            start = node.all_start_micros
            end = start + max(node.all_end_rel_micros, 0)
            spans.append((start, end))
            if node.node_name in names:
                exchange.append((start, end))
    if not spans:
        raise ValueError("row_exchange_share: the RunMetadata holds no step stats; run the step with "
                         "options=traced_run_options()")
    step = max(e for _, e in spans) - min(s for s, _ in spans)
    return _union_length(exchange) / step if step > 0 else 0.0
