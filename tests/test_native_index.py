"""The native key index against a plain Python dict / numpy oracle."""
import numpy as np
import pytest
import shardrec_native as native


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
        slots, restore, num_unique = index.process_batch(keys, True)
        unique = keys[np.sort(np.unique(keys, return_index=True)[1])]
        assert num_unique == len(unique)
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
    index.process_batch(np.array([1, 2, 3], np.int64), True)
    slots, restore, _ = index.process_batch(np.array([3, 99, 1, 99], np.int64), False)
    np.testing.assert_array_equal(slots[restore], [2, index.sentinel, 0, index.sentinel])
    assert index.size() == 3
    assert index.counters()["missed"] == 1


def test_static_padding_and_overflow_error():
    index = native.EmbeddingIndex("padded", 100)
    slots, restore, n = index.process_batch(np.array([5, 6, 5], np.int64), True, 4)
    np.testing.assert_array_equal(slots, [0, 1, index.sentinel, index.sentinel])
    assert n == 2
    with pytest.raises(native.CapacityError, match=r"'padded'.*3 unique keys.*send_count=2"):
        index.process_batch(np.array([7, 8, 9], np.int64), True, 2)


def test_full_table_error_names_table_and_capacity():
    index = native.EmbeddingIndex("small", 4)
    with pytest.raises(native.CapacityError, match=r"'small'.*full \(4 rows"):
        index.process_batch(np.arange(10, dtype=np.int64), True)
    with pytest.raises(ValueError, match="capacity"):
        native.EmbeddingIndex("bad", 0)


def test_float_keys_are_rejected():
    index = native.EmbeddingIndex("t", 10)
    with pytest.raises(TypeError):
        index.process_batch(np.array([1.5, 2.0]), True)
