"""The native index with an SSD tier, driven directly (no TensorFlow): exact pins, swap policies,
moves, eviction, restore placement and damaged records."""
import os

import numpy as np
import pytest

from shardrec.native import core as native


def tiered_index(tmp_path, memory=8, ssd=64, dim=2, policy="lfu", name="t"):
    store = native.RowStore(name, dim, memory + 1, 0, 0, 0.5, 0.0, 0, 1.0)
    index = native.EmbeddingIndex(name, memory, store)
    index.set_ssd(ssd, [str(tmp_path)], 0, policy)
    return index, store


def batch(index, store, keys, gathered=True):
    """One training batch as the exchange and the step run it: looked up, then (gathered=True)
    its rows read by the step, which makes the batches before it done."""
    ticket = index.begin_batch(0)
    slots = index.lookup(np.array(keys, np.int64), allocate=True)
    if gathered:
        store.note_gathered(0, ticket)
    return slots


def rows_of(index, keys):
    keys = np.array(keys, np.int64)
    exported_keys, locs = index.export()
    where = dict(zip(exported_keys.tolist(), locs.tolist()))
    return index.read_rows(0, keys, np.array([where[k] for k in keys.tolist()], np.int32))


def test_rows_keep_their_values_through_swaps_and_export_reads_every_tier(tmp_path):
    index, store = tiered_index(tmp_path, memory=8, ssd=64)
    for start in range(0, 40, 4):
        keys = np.arange(start, start + 4)
        slots = batch(index, store, keys)
        assert slots.max() < 8
        store.write_rows(0, slots, np.repeat(keys[:, None], 2, 1).astype(np.float32))
    assert index.size() == 40 and index.rows_on_ssd() >= 32
    np.testing.assert_array_equal(rows_of(index, range(40)), np.repeat(np.arange(40)[:, None], 2, 1))
    slots = batch(index, store, [3, 17, 38])  # two on SSD, brought back
    np.testing.assert_array_equal(store.read_rows(0, slots), [[3, 3], [17, 17], [38, 38]])
    c = index.tier_counters()
    assert c.swapped_in >= 2 and c.swapped_out == index.rows_on_ssd() + c.swapped_in


def test_rows_of_batches_not_yet_trained_never_move(tmp_path):
    """Batches looked up ahead of training pin their rows until the step after theirs is read;
    when every memory row is pinned the lookup stops with a clear error and moves nothing."""
    index, store = tiered_index(tmp_path, memory=8, ssd=64)
    first = batch(index, store, [1, 2, 3, 4], gathered=False)
    batch(index, store, [5, 6, 7, 8], gathered=False)
    with pytest.raises(native.CapacityError, match="cannot hold the rows of the batches in flight"):
        batch(index, store, [9], gathered=False)
    assert index.rows_on_ssd() == 0
    store.note_gathered(0, 2)  # the second batch is read: the first one's step is done
    batch(index, store, [9, 10], gathered=False)
    keys, locs = index.export()
    where = dict(zip(keys.tolist(), locs.tolist()))
    assert sum(where[k] > 8 for k in (1, 2, 3, 4)) == 2, where  # two of the first batch's rows moved
    assert all(where[k] < 8 for k in (5, 6, 7, 8, 9, 10)), where
    assert set(first.tolist()) >= {where[k] for k in (9, 10)}, "their rows were taken"



@pytest.mark.parametrize("policy,moved", [("lru", {1, 2}), ("lfu", {5, 6})])
def test_the_swap_policy_chooses_which_rows_move_first(tmp_path, policy, moved):
    """Keys 1, 2 used often long ago; 5, 6 once, lately: LRU moves 1 and 2, LFU moves 5 and 6."""
    index, store = tiered_index(tmp_path, memory=16, ssd=64, policy=policy)
    for _ in range(5):
        batch(index, store, [1, 2])
    batch(index, store, [5, 6])
    for k in range(7, 21):  # fills memory with keys of two uses each, then needs room for two more
        batch(index, store, [k])
        batch(index, store, [k])
    keys, locs = index.export()
    on_ssd = {k for k, loc in zip(keys.tolist(), locs.tolist()) if loc > 16}
    assert moved <= on_ssd and not ({1, 2, 5, 6} - moved) & on_ssd, on_ssd


def test_the_ssd_share_full_is_an_error_before_any_row_moves(tmp_path):
    index, store = tiered_index(tmp_path, memory=8, ssd=4)
    batch(index, store, range(8))
    batch(index, store, [])  # the next step: the first batch's rows may move
    before = index.export()
    with pytest.raises(native.CapacityError, match=r"SSD tier is full on rank 0 \(4 rows, its share of "
                                                   "ssd_vocabulary_size\\); raise ssd_vocabulary_size"):
        batch(index, store, range(8, 16))
    after = index.export()
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])


def test_eviction_and_erase_remove_keys_from_whichever_tier_holds_them(tmp_path):
    index, store = tiered_index(tmp_path, memory=8, ssd=64)
    index.set_admission(0, 10)
    for step, start in enumerate(range(0, 32, 4)):
        index.begin_step(step)
        ticket = index.begin_batch(0)
        keys = np.arange(start, start + 4, dtype=np.int64)
        index.lookup_counted(keys, np.ones(4, np.int64), np.full(4, 100 + step, np.int64))
        store.note_gathered(0, ticket)
    on_ssd = index.rows_on_ssd()
    assert on_ssd >= 24
    index.newest = 115  # keys last seen at 100..105 (steps 0..5) are now at least 10 old
    index.begin_step(8)
    assert index.evict(8) == 24
    index.release_evicted(9)  # held-back rows and records are free again
    keys, _ = index.export()
    assert sorted(keys.tolist()) == list(range(24, 32))
    assert index.rows_on_ssd() == 0, "the SSD records of evicted keys are free"
    batch(index, store, range(40, 44))  # moves 24..27 down (28..31 are the last batch's, pinned)
    assert index.rows_on_ssd() == 4 and index.erase(np.array([24, 31, 40], np.int64)) == 3
    assert index.rows_on_ssd() == 3
    assert sorted(index.export()[0].tolist()) == list(range(25, 31)) + list(range(41, 44))


def test_restore_places_rows_in_memory_first_then_on_ssd(tmp_path):
    index, _ = tiered_index(tmp_path, memory=4, ssd=64)
    keys = np.arange(100, 110, dtype=np.int64)
    locs = index.place(keys)
    assert (locs[:4] < 4).all() and (locs[4:] > 4).all()
    values = np.arange(20, dtype=np.float32).reshape(10, 2)
    index.write_rows(0, keys, locs, values)
    np.testing.assert_array_equal(index.read_rows(0, keys, locs), values)


def test_a_record_overwritten_on_disk_is_refused_naming_the_file(tmp_path):
    index, store = tiered_index(tmp_path, memory=4, ssd=64)
    for k in range(12):
        batch(index, store, [k])
    [path] = index.ssd_files()
    with open(path, "r+b") as f:
        f.seek(4096 + 3)
        f.write(b"\xff\xff")
    with pytest.raises(native.TierDamagedError, match=f"SSD file {path} is damaged: record 0"):
        batch(index, store, [0])  # the first row moved down
    index.close_ssd()
    assert os.listdir(tmp_path) == []
