"""The column-wise placement's rules on one rank, in this process: where its slices live, how a plan
file names it, what the planner makes of it (the multi-rank oracles: test_sharding.py and
test_pooled_lookup.py)."""
import numpy as np
import pytest

from shardrec.rank_runtime import ShardingPlan, TableShape, plan_sharding
from shardrec.rank_runtime.embedding.planner import table_cost
from shardrec.rank_runtime.formats.sharding_plan import Placement, PlanError

pytestmark = pytest.mark.quick


def test_a_column_wise_placement_splits_each_row_over_consecutive_ranks():
    p = Placement.checked("t", "column_wise", [1, 2], 4)
    assert (p.rank, p.slices, p.native, p.native_slices) == (1, 2, 1, 2)
    assert p.ranks(4) == [1, 2] and p.row_dim(8) == 4
    assert [p.columns_on(r, 8) for r in range(4)] == [slice(0, 4), slice(0, 4), slice(4, 8), slice(0, 4)]
    keys = np.array([-3, 0, 5, 2**40])
    assert [p.holds(keys, r, 4).tolist() for r in range(4)] == [[False] * 4, [True] * 4, [True] * 4, [False] * 4]
    assert [p.rows_on(r, 4, 100) for r in range(4)] == [1, 100, 100, 1]
    assert p.describe() == "column_wise on ranks 1,2" and p.to_json() == {"sharding": "column_wise", "ranks": [1, 2]}
    assert Placement.from_json("t", p.to_json(), 4, "p.json") == p
    p.check_dim("t", 6)
    with pytest.raises(PlanError, match=r"table 't': dim 5 does not split into 2 equal column slices \(ranks \[1, 2\]\); "
                                        r"allowed: a number of ranks that divides the dim \(\[1, 5\]\)"):
        p.check_dim("t", 5)


@pytest.mark.parametrize("ranks", [[0, 2], [2, 1], [1, 4], [True], "01", 1])
def test_column_wise_ranks_that_are_not_consecutive_ranks_of_the_world_are_refused(ranks):
    with pytest.raises(PlanError, match=r"table 't': column-wise ranks .*; allowed: a list of consecutive ranks in "
                                        r"\[0, 3\], one slice of the row's columns on each"):
        Placement.checked("t", "column_wise", ranks, 4)


def test_the_planner_picks_the_ranks_of_a_column_wise_table_and_a_split_of_its_dim():
    """sharding='column_wise' with no ranks: the planner's choice among the splits of the dim over
    consecutive ranks; a dim no number of ranks divides gets one slice; the plan keeps the ranks."""
    plan = plan_sharding([TableShape("w", 10**5, 6, ids_per_step=4096, sharding="column_wise"),
                          TableShape("x", 10**5, 7, ids_per_step=4096, sharding="column_wise")], 4)
    w, x = plan.placement("w"), plan.placement("x")
    assert w.kind == "column_wise" and w.slices in (2, 3) and 6 % w.slices == 0 and w.rank + w.slices <= 4
    assert (x.kind, x.slices) == ("column_wise", 1)
    assert ShardingPlan.from_json(plan.to_json(), "round trip").to_json() == plan.to_json()
    assert "column_wise on ranks" in plan.render()
    with pytest.raises(PlanError, match=r"table 'v': dim 6 does not split into 4 equal column slices"):
        plan_sharding([TableShape("v", 100, 6, sharding="column_wise", rank=[0, 1, 2, 3])], 4)


def test_the_planner_splits_a_hot_wide_table_by_columns_and_costs_it_as_the_exchanges_move_it():
    """A wide table whose ids are few and the same on every rank: every rank works on all of them
    under replication, each slice rank on its columns alone under column-wise, which moves the same
    bytes; the planner prefers the split. The estimate's bytes are the key round's and the row
    exchanges' (keys to every slice rank, a slice of rows back, a slice of gradients out)."""
    hot = TableShape("hot", 1000, 512, ids_per_step=4096, distinct_per_step=1000)
    assert plan_sharding([hot], 2).placement("hot").describe() == "column_wise on ranks 0,1"
    cost = table_cost(hot, Placement("column_wise", 0, 2), 2)
    u, part = 1000, 4 * 512 // 2
    assert cost.bytes_sent == ((2 - 1) * u * part + u * (8 + part),) * 2
    assert cost.memory == (1000 * hot.bytes_per_row // 2,) * 2  # a slice's share of each row's values and slots


@pytest.mark.parametrize("missing_column", [False, True])
def test_slices_come_back_side_by_side_from_padded_blocks_with_the_missing_key_flag_once(missing_column):
    """The requester's join (lookup._slices_joined) on 3 ranks, the table on ranks 1 and 2, static
    shapes (every block padded to 4 rows): id i's row is its slice from rank 1, then rank 2's; with
    serving_default_value each slice carries the missing-key flag and the joined row has it once."""
    import types

    import tensorflow as tf

    from shardrec.rank_runtime.pipeline.lookup import _slices_joined

    dim, pad, unique = 6, 4, 3
    rng = np.random.default_rng(1)
    whole = rng.normal(size=(unique, dim)).astype(np.float32)
    flag = np.array([[0.0], [1.0], [0.0]], np.float32)
    blocks = []
    for rank in range(3):  # rank 0 holds no slice: padding only
        block = np.full((pad, dim // 2 + missing_column), 9.0, np.float32)
        if rank > 0:
            part = whole[:, (rank - 1) * 3:rank * 3]
            block[:unique] = np.concatenate([part, flag], 1) if missing_column else part
        blocks.append(block)
    ids = np.array([2, 0, 0, 1, 2], np.int32)  # each id's unique key, as the key round restores it
    table = types.SimpleNamespace(placement=Placement("column_wise", 1, 2), row_dim=dim // 2)
    with tf.Graph().as_default():
        routing = types.SimpleNamespace(recv_splits=tf.constant([pad] * 3, tf.int32), restore=tf.constant(pad + ids))
        joined = _slices_joined(table, tf.constant(np.concatenate(blocks)), routing)
        with tf.compat.v1.Session() as sess:
            got = sess.run(joined)
    expected = np.concatenate([whole, flag], 1)[ids] if missing_column else whole[ids]
    np.testing.assert_array_equal(got, expected)


def test_a_slice_rank_that_answers_too_late_is_never_read_as_a_later_save():
    """A save's rows from a slice rank that came after the first slice rank gave up (a frozen rank):
    the first slice rank's wait times out, and its every later exchange of slices fails at once
    naming why, rather than taking the late rows for the next save's (tests/mpi_jobs/slice_arrays.py).
    The late rank's small sends may complete on its side (MPI sends them eagerly); its save then
    fails in the save's agreement, as the first slice rank's does."""
    import re

    from mpi_helpers import check, mpiexec

    out = check(mpiexec(2, "slice_arrays.py", timeout=120)).stdout
    assert re.search(r"ROUND1 rank=0 TimeoutError: round 1: waiting for rank 1: no answer within 1 s", out), out
    assert re.search(r"ROUND2 rank=0 RuntimeError: round 2: waiting for rank 1: a rank gave no answer within 1 s on "
                     r"an earlier save; the column slices' ranks are out of step", out), out
    assert "GOT" not in out, out
