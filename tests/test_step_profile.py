"""row_exchange_share against hand-computed spans: overlapping all-to-alls count once."""
import pytest
import tensorflow as tf

from shardrec.rank_runtime.pipeline.step_profile import row_exchange_share


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


def _step(compute=(), inputs=(), exchanges=None):
    from shardrec.rank_runtime.pipeline.step_profile import TracedStep

    return TracedStep(tuple(compute), tuple(inputs), dict(exchanges or {}))


def test_a_step_is_cut_into_parts_that_add_up_to_its_span():
    from shardrec.rank_runtime.pipeline.step_profile import split_step

    # [0, 10) waiting for the batch; compute [10, 40) and [90, 100); the row exchange [30, 90),
    # the last rank reaching it at 60: [40, 60) waiting for that rank, [60, 90) moving rows (its
    # part under compute, [30, 40), is compute); the gradient exchange [100, 120), every rank there
    # at 100; nothing runs in [120, 130), then compute [130, 140).
    step = _step(compute=[(10, 40), (90, 100), (130, 140)], inputs=[(0, 10)],
                 exchanges={"t/f/train#0": (30, 90), "t/f/train#0 gradients": (100, 120)})
    split = split_step(step, {"t/f/train#0": 60, "t/f/train#0 gradients": 95})
    assert split.span == 140
    assert (split.compute, split.input_wait, split.idle) == (50, 10, 10)
    assert split.waiting == {"t/f/train#0": 20}
    assert split.moving == {"t/f/train#0": 30, "t/f/train#0 gradients": 20}
    assert split.compute + split.input_wait + split.idle + sum(split.waiting.values()) + \
        sum(split.moving.values()) == split.span


def test_a_wait_hidden_behind_compute_costs_nothing_and_labels_group_collectives():
    from shardrec.rank_runtime.pipeline.step_profile import split_step

    step = _step(compute=[(0, 100)], exchanges={"hvd_a": (10, 50), "hvd_b": (60, 120)})
    split = split_step(step, {"hvd_a": 40, "hvd_b": 110}, {"hvd_a": "Horovod", "hvd_b": "Horovod"})
    assert (split.span, split.compute) == (120, 100)
    assert split.waiting == {"Horovod": 10} and split.moving == {"Horovod": 10}


def test_a_timeline_table_puts_ranks_side_by_side():
    from shardrec.rank_runtime.pipeline.step_profile import format_columns

    def rank(r, wait):
        return {"rank": r, "steps": 10, "step_ms": 9.0, "cpu_ms": 8.5, "input_bound_steps": r,
                "split_ms": {"compute": 5.0, "waiting for a rank: t/f/train#0": wait, "traced span": 8.0},
                "pipeline_ms": {"batches": 40, "work": 3.0, "cpu": 2.5, "waiting_for_ranks": 1.0}}

    text = format_columns([("1 rank", {**rank(0, 0.0), "split_ms": {"compute": 6.0, "traced span": 7.0}}),
                           ("2: rank 0", rank(0, 0.5)), ("2: rank 1", rank(1, 1.5))])
    lines = text.splitlines()
    assert lines[0].index("1 rank") < lines[0].index("2: rank 0") < lines[0].index("2: rank 1"), lines[0]
    waiting = next(line for line in lines if "waiting for a rank: t/f/train#0" in line)
    assert waiting.split()[-3:] == ["0.00", "0.50", "1.50"]
    compute = next(line for line in lines if line.strip().startswith("compute"))
    assert compute.split()[-3:] == ["6.00", "5.00", "5.00"]
    assert "1 of 10" in lines[-1] and "0 of 10" in lines[-1]
