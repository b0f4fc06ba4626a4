"""The native key index against a plain Python dict / numpy oracle."""
import numpy as np
import pytest
from shardrec.native import core as native
from mpi4py import MPI

pytestmark = pytest.mark.quick


def insert_batch(index, keys):
    """Dedup then allocate, as the owner does for one batch: (slots of unique keys, restore)."""
    unique, restore = native.dedup(keys)
    return index.lookup(unique, True), restore


def test_dedup_matches_numpy_unique_in_first_seen_order():
    rng = np.random.default_rng(1)
    keys = rng.integers(-(2**62), 2**62, size=200).repeat(rng.integers(1, 5, size=200))
    rng.shuffle(keys)
    unique, restore = native.dedup(keys)
    _, first = np.unique(keys, return_index=True)
    np.testing.assert_array_equal(unique, keys[np.sort(first)])
    np.testing.assert_array_equal(unique[restore], keys)


def test_dedup_int32_and_empty():
    keys = np.array([3, -7, 3, 2**31 - 1, -(2**31)], np.int32)
    unique, restore = native.dedup(keys)
    np.testing.assert_array_equal(unique, [3, -7, 2**31 - 1, -(2**31)])
    assert unique.dtype == np.int64
    np.testing.assert_array_equal(unique[restore], keys)
    unique, restore = native.dedup(np.array([], np.int64))
    assert unique.size == 0 and restore.size == 0


def test_index_against_dict_with_growth_erase_and_slot_reuse():
    rng = np.random.default_rng(7)
    capacity = 8000
    index = native.EmbeddingIndex("oracle", capacity)
    oracle = {}
    free = []
    next_slot = 0
    for step in range(60):
        keys = rng.integers(-3000, 3000, size=300) * 1_000_003
        slots, restore = insert_batch(index, keys)
        unique = keys[np.sort(np.unique(keys, return_index=True)[1])]
        assert len(slots) == len(unique)
        for k, s in zip(unique.tolist(), slots.tolist()):
            if k not in oracle:
                oracle[k] = free.pop() if free else next_slot
                if oracle[k] == next_slot:
                    next_slot += 1
            assert oracle[k] == s
        np.testing.assert_array_equal(slots[restore], [oracle[k] for k in keys.tolist()])
        if step % 10 == 9:
            victims = rng.choice(sorted(oracle), size=100, replace=False)
            assert index.erase(np.asarray(victims, np.int64)) == 100
            for k in victims.tolist():
                free.append(oracle.pop(k))
        assert index.size() == len(oracle)
    keys, slots = index.export()
    assert dict(zip(keys.tolist(), slots.tolist())) == oracle
    assert np.all(np.diff(slots) > 0), "export is in slot order"
    # Erased keys are unknown again; erasing them twice removes nothing.
    assert index.erase(np.asarray(victims, np.int64)) == 0


def test_eval_lookup_never_allocates_and_reads_sentinel():
    index = native.EmbeddingIndex("t", 10)
    insert_batch(index, np.array([1, 2, 3], np.int64))
    slots = index.lookup(np.array([3, 99, 1, 99], np.int64), False)
    np.testing.assert_array_equal(slots, [2, index.sentinel, 0, index.sentinel])
    assert index.size() == 3
    assert index.counters().missed == 2


def one_feature(index, send_count=0, int32_keys=False, name="f"):
    return native.FeatureSet([name], [index], [send_count], [int32_keys], f"feature {name}")


def new_exchange(channel=native.Channel.TRAIN, timeout_s=30.0):
    return native.KeyExchange(MPI.COMM_SELF.Dup(), channel, timeout_s)


def routed(result):
    """Per feature: (rows, expand, send_splits, restore, ticket) of an exchange that did not end."""
    assert not result.ended
    return [(r.rows, r.expand, r.send_splits, r.restore, r.ticket) for r in result.features]


def test_single_rank_exchange_dedups_pads_and_restores():
    index = native.EmbeddingIndex("padded", 100)
    exchange = new_exchange()
    keys = np.array([[5, 6], [5, -2]], np.int64)
    [(slots, expand, recv, restore, _)] = routed(exchange.run(one_feature(index, 4), [keys], True))
    # Padded to send_count=4: three keys and the sentinel; distinct rows, expanded per received key.
    np.testing.assert_array_equal(slots, [0, 1, 2, index.sentinel])
    np.testing.assert_array_equal(slots[expand], [0, 1, 2, index.sentinel])
    np.testing.assert_array_equal(recv, [4])
    np.testing.assert_array_equal(slots[expand][restore], [0, 1, 0, 2])
    [(slots, expand, recv, restore, _)] = routed(exchange.run(one_feature(index), [keys.astype(np.int32)], True))
    np.testing.assert_array_equal(slots, [0, 1, 2])
    assert expand.size == 0, "one rank, dynamic shapes: the received keys are distinct already"
    np.testing.assert_array_equal(recv, [3])
    np.testing.assert_array_equal(slots[restore], [0, 1, 0, 2])
    assert exchange.run(one_feature(index), [keys], False).ended, "no data on the only rank ends the pass"
    assert exchange.ranks_out_of_data == [0]
    assert index.counters().keys_sent == 6 and index.counters().keys_received == 6
    assert exchange.counters().batches == 3


def test_static_overflow_error_names_table_ranks_and_send_count():
    index = native.EmbeddingIndex("padded", 100)
    exchange = new_exchange()
    with pytest.raises(native.ExchangeError, match=r"feature 'f' of table 'padded': rank 0 has 3 unique keys for "
                                                   r"rank 0, more than send_count=2; raise send_count to at least 3"):
        exchange.run(one_feature(index, 2), [np.array([7, 8, 9], np.int64)], True)
    assert index.size() == 0, "nothing is allocated for a refused batch"
    # The channel is stopped: a batch that would fit raises the same error, without a collective.
    with pytest.raises(native.ExchangeError, match=r"send_count=2.*this channel stopped at batch 0"):
        exchange.run(one_feature(index, 2), [np.array([7], np.int64)], True)
    assert "send_count=2" in exchange.stopped
    exchange.restart()
    [(slots, _, _, restore, _)] = routed(exchange.run(one_feature(index, 2), [np.array([7], np.int64)], True))
    assert index.size() == 1


def test_int32_table_refuses_ids_beyond_int32_naming_feature_and_table():
    index = native.EmbeddingIndex("small_ids", 100)
    exchange = new_exchange()
    ok = np.array([-(2**31), 2**31 - 1], np.int64)
    exchange.run(one_feature(index, int32_keys=True, name="user"), [ok], True)
    with pytest.raises(native.ExchangeError, match=r"feature 'user' on rank 0 has id 2147483648, outside table "
                                                   r"'small_ids''s key dtype int32"):
        exchange.run(one_feature(index, int32_keys=True, name="user"), [np.array([1, 2**31], np.int64)], True)
    assert index.size() == 2, "nothing of the refused batch is inserted"


def test_eval_exchange_never_allocates():
    index = native.EmbeddingIndex("t", 10)
    insert_batch(index, np.array([4], np.int64))
    exchange = new_exchange(native.Channel.EVAL)
    [(slots, _, _, restore, _)] = routed(exchange.run(one_feature(index), [np.array([4, 8, 4], np.int64)], True))
    np.testing.assert_array_equal(slots[restore], [0, index.sentinel, 0])
    assert index.size() == 1


def test_owner_rule_is_the_mathematical_modulo():
    for key in (-(2**63), -7, -1, 0, 1, 7, 2**63 - 1):
        for world in (1, 2, 3, 4, 7):
            assert native.owner_of(key, world) == key % world


def test_the_exchange_routes_every_key_to_the_mathematical_modulo():
    """owners_of is what the key exchange routes by (a mask for a world of a power of two, a
    division otherwise): numpy's modulo of the same keys, negative and extreme keys included."""
    rng = np.random.default_rng(3)
    keys = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 20000, dtype=np.int64), np.arange(-70, 70),
                           np.array([-(2**63), -(2**63) + 1, 2**63 - 1, -1, 0], np.int64)])
    for world in range(1, 10):
        np.testing.assert_array_equal(native.owners_of(keys, world), np.mod(keys, world), err_msg=f"world {world}")
    for bad in (0, -2):
        with pytest.raises(ValueError, match=f"world_size must be at least 1, got {bad}"):
            native.owners_of(keys, bad)
        with pytest.raises(ValueError, match="world_size must be at least 1"):
            native.owner_of(5, bad)


def test_full_table_error_names_table_and_capacity():
    index = native.EmbeddingIndex("small", 4)
    with pytest.raises(native.CapacityError, match=r"'small'.*full \(4 rows"):
        index.lookup(np.arange(10, dtype=np.int64), True)
    with pytest.raises(ValueError, match="capacity"):
        native.EmbeddingIndex("bad", 0)


def test_float_keys_are_rejected():
    index = native.EmbeddingIndex("t", 10)
    with pytest.raises(TypeError):
        index.lookup(np.array([1.5, 2.0]), True)
    exchange = new_exchange()
    with pytest.raises(TypeError, match="feature 'f': ids must be int32 or int64"):
        exchange.run(one_feature(index), [np.array([1.5])], True)


def test_a_channel_that_is_neither_train_nor_eval_is_refused():
    index = native.EmbeddingIndex("t", 10)
    with pytest.raises(ValueError, match=r"channel must be Channel.TRAIN \(0\) or Channel.EVAL \(1\), got 5"):
        index.begin_batch(5)
    with pytest.raises(ValueError, match="got 2"):
        new_exchange(2)
    assert index.begin_batch(native.Channel.EVAL) == 1
