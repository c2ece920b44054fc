"""BlockAllocator and KVCache: slots, block growth, free, fork + copy-on-write + copy_blocks, errors."""

from __future__ import annotations

import pytest
import torch

from compiled_attn.block_allocator import slot_of
from compiled_attn.kv_cache import BlockAllocator, KVCache, OutOfBlocksError


def append_slot(alloc, seq_id, position):
    """Slot of token ``position`` of ``seq_id``, allocating a block when needed."""
    return slot_of(alloc.allocate(seq_id, position + 1), position, alloc.block_size)
from compiled_attn.ops import copy_blocks


def test_allocate_rounds_up_to_whole_blocks_and_hands_out_distinct_ids():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    assert alloc.num_free_blocks == 8
    table_a = alloc.allocate(0, 5)  # ceil(5/4) = 2 blocks
    assert len(table_a) == 2
    table_b = alloc.allocate(1, 4)  # exactly one block
    assert len(table_b) == 1
    table_c = alloc.allocate(2, 1)
    assert len(table_c) == 1
    ids = table_a + table_b + table_c
    assert len(set(ids)) == 4 and all(0 <= b < 8 for b in ids)
    assert alloc.num_free_blocks == 4
    assert alloc.block_tables == {0: table_a, 1: table_b, 2: table_c}


def test_allocate_grows_an_existing_table_only_by_what_is_missing():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    table = list(alloc.allocate(0, 3))
    assert alloc.blocks_needed(0, 4) == 0
    assert alloc.allocate(0, 4) == table  # still fits in one block
    assert alloc.blocks_needed(0, 9) == 2
    grown = alloc.allocate(0, 9)
    assert grown[:1] == table and len(grown) == 3
    assert alloc.num_free_blocks == 5
    assert alloc.allocate(0, 2) == grown  # never shrinks
    assert alloc.num_free_blocks == 5


def test_slot_is_block_id_times_block_size_plus_offset():
    block_size = 4
    alloc = BlockAllocator(num_blocks=16, block_size=block_size)
    # Interleave another sequence so seq 0's blocks are not contiguous ids.
    slots = []
    for pos in range(11):
        slots.append(append_slot(alloc, 0, pos))
        if pos % 3 == 0:
            append_slot(alloc, 100 + pos, 0)
    table = alloc.block_tables[0]
    assert len(table) == 3  # positions 0..10 -> 3 blocks of 4
    for pos, slot in enumerate(slots):
        assert slot == table[pos // block_size] * block_size + pos % block_size
    assert len(set(slots)) == 11
    # A new block for seq 0 exactly when a position crosses a block boundary.
    new_blocks = []
    alloc2 = BlockAllocator(num_blocks=16, block_size=block_size)
    for pos in range(11):
        before = alloc2.num_free_blocks
        append_slot(alloc2, 7, pos)
        new_blocks.append(before - alloc2.num_free_blocks)
    assert new_blocks == [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0]


def test_slot_maps_to_the_block_that_holds_the_token():
    alloc = BlockAllocator(num_blocks=6, block_size=3)
    alloc.allocate(9, 2)  # take block 0 for someone else first
    for pos in range(7):
        slot = append_slot(alloc, 1, pos)
        block, offset = divmod(slot, 3)
        assert block == alloc.block_tables[1][pos // 3]
        assert offset == pos % 3


def test_free_returns_blocks_and_they_are_reused():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    a = list(alloc.allocate(0, 4))
    b = list(alloc.allocate(1, 4))
    assert alloc.num_free_blocks == 0
    alloc.free(0)
    assert alloc.num_free_blocks == 2
    assert 0 not in alloc.block_tables
    c = alloc.allocate(2, 3)
    assert sorted(c) == sorted(a)  # the freed blocks come back
    assert not set(c) & set(b)
    alloc.free(1)
    alloc.free(2)
    alloc.free(12345)  # unknown id: no-op
    alloc.free(2)  # double free: no-op, no duplicate ids
    assert alloc.num_free_blocks == 4
    assert sorted(alloc.allocate(3, 8)) == [0, 1, 2, 3]


def test_out_of_blocks_names_request_and_free_count_and_allocates_nothing():
    alloc = BlockAllocator(num_blocks=5, block_size=4)
    alloc.allocate(0, 12)  # 3 blocks, 2 left
    before_tables = {k: list(v) for k, v in alloc.block_tables.items()}
    with pytest.raises(OutOfBlocksError) as info:
        alloc.allocate(1, 13)  # needs 4 blocks
    msg = str(info.value)
    assert "4" in msg and "13" in msg  # blocks asked for, tokens asked for
    assert "2" in msg and "5" in msg  # free and total
    assert "sequence 1" in msg
    assert alloc.num_free_blocks == 2
    assert {k: list(v) for k, v in alloc.block_tables.items()} == before_tables
    # Growing an existing sequence past the pool fails the same way, nothing taken.
    with pytest.raises(OutOfBlocksError, match="needs 3 more blocks"):
        alloc.allocate(0, 24)
    assert alloc.num_free_blocks == 2
    assert alloc.block_tables[0] == before_tables[0]
    # allocating one more token goes through the same check.
    alloc.allocate(2, 8)
    with pytest.raises(OutOfBlocksError):
        append_slot(alloc, 3, 0)
    assert alloc.num_free_blocks == 0
    assert isinstance(OutOfBlocksError("x"), RuntimeError)


def test_allocator_rejects_non_positive_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockAllocator(4, 0)


def test_fork_shares_blocks_and_copy_on_write_gives_a_private_copy():
    torch.manual_seed(0)
    num_blocks, block_size, heads, head_size = 10, 4, 2, 8
    cache = KVCache.allocate(2, num_blocks, block_size, heads, head_size, torch.float32, "cpu")
    for k, v in cache.layers:
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    alloc = cache.allocator
    parent = list(alloc.allocate(0, 10))  # 3 blocks, the last one partial (tokens 8, 9)
    before = alloc.num_free_blocks
    alloc.fork(0, 1)
    assert alloc.block_tables[1] == parent and alloc.num_free_blocks == before  # shared, nothing taken
    assert alloc.copy_on_write(1, 4) is not None  # block 1 is shared too: a write there copies it
    alloc.free(1)
    alloc.fork(0, 1)
    assert alloc.copy_on_write(0, 20) is None  # a position beyond the table: nothing to copy
    src, dst = alloc.copy_on_write(1, 10)  # the child writes token 10: into the shared last block
    child = alloc.block_tables[1]
    assert src == parent[2] and child == parent[:2] + [dst] and dst not in parent
    assert alloc.copy_on_write(1, 11) is None and alloc.copy_on_write(0, 10) is None  # now both private
    assert alloc.num_free_blocks == before - 1
    snapshot = [(k.clone(), v.clone()) for k, v in cache.layers]
    copy_blocks([k for k, _ in cache.layers], [v for _, v in cache.layers], torch.tensor([[src, dst]]))
    for (k, v), (k0, v0) in zip(cache.layers, snapshot):
        assert torch.equal(k[dst], k0[src]) and torch.equal(v[dst], v0[src])
        others = sorted(set(range(num_blocks)) - {dst})
        assert torch.equal(k[others], k0[others]) and torch.equal(v[others], v0[others])
    alloc.free(0)  # the shared blocks stay with the child
    assert alloc.block_tables[1] == child and alloc.num_free_blocks == before  # only its private block came back
    alloc.free(1)
    assert alloc.num_free_blocks == num_blocks


def test_copy_on_write_without_a_free_block_raises():
    alloc = BlockAllocator(num_blocks=3, block_size=2)
    alloc.allocate(0, 5)  # 3 blocks, none free
    alloc.fork(0, 1)
    with pytest.raises(OutOfBlocksError, match="copy-on-write"):
        alloc.copy_on_write(1, 5)
    assert alloc.block_tables[1] == alloc.block_tables[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kvcache_allocate_shapes_dtypes_and_zeros(dtype):
    cache = KVCache.allocate(num_layers=3, num_blocks=7, block_size=16, num_kv_heads=2,
                             head_size=32, dtype=dtype, device="cpu")
    assert len(cache.layers) == 3
    seen = set()
    for k, v in cache.layers:
        for t in (k, v):
            assert t.shape == (7, 16, 2, 32)
            assert t.dtype == dtype
            assert t.device.type == "cpu"
            assert not t.any()
            seen.add(t.data_ptr())
    assert len(seen) == 6  # every tensor is its own storage
    assert cache.block_size == 16
    assert cache.allocator.num_blocks == 7 and cache.allocator.num_free_blocks == 7
    expected = 2 * 3 * 16 * 2 * 32 * torch.tensor([], dtype=dtype).element_size()
    assert KVCache.bytes_per_block(3, 16, 2, 32, dtype) == expected


def test_kvcache_layers_are_independent():
    cache = KVCache.allocate(2, 3, 2, 2, 8, torch.float32, "cpu")
    cache.layers[0][0][1].fill_(1.0)
    assert not cache.layers[0][1].any()
    assert not cache.layers[1][0].any()
