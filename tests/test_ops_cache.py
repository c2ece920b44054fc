"""KV-cache ops: reshape_and_cache, copy_blocks, swap_blocks.

Caches are filled with random values first; every test checks the slots/blocks that must
be written AND that every other element is bit-for-bit unchanged.
"""

from __future__ import annotations

import pytest
import torch

import compiled_attn  # noqa: F401
from compiled_attn.ops import PAD_SLOT_ID, copy_blocks, paged_attention, reshape_and_cache, swap_blocks

from oracle import assert_close_to_oracle, oracle_paged
from paged_batches import make_paged_batch, pad, randn_nonzero

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def _cache(num_blocks, block_size, heads, head_size, dtype, g):
    return randn_nonzero((num_blocks, block_size, heads, head_size), dtype, g)


# --- reshape_and_cache -----------------------------------------------------------------------


@pytest.mark.parametrize("head_size", [16, 72, 111])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_writes_exact_slots_and_skips_pad(block_size, dtype, head_size):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, heads = 6, 2
    key_cache = _cache(num_blocks, block_size, heads, head_size, dtype, g)
    value_cache = _cache(num_blocks, block_size, heads, head_size, dtype, g)
    k_before, v_before = key_cache.clone(), value_cache.clone()
    num_slots = num_blocks * block_size
    slots = [s for s in torch.randperm(num_slots, generator=g)[:20].tolist()
             if s not in (0, num_slots - 1)]
    # first slot, last slot, and PAD_SLOT_ID (-1) rows at the start, middle and end
    slot_list = [PAD_SLOT_ID, 0, *slots[:9], PAD_SLOT_ID, num_slots - 1, *slots[9:], PAD_SLOT_ID]
    slot_mapping = torch.tensor(slot_list, dtype=torch.int64)
    num_tokens = slot_mapping.shape[0]
    key = randn_nonzero((num_tokens, heads, head_size), dtype, g)
    value = randn_nonzero((num_tokens, heads, head_size), dtype, g)

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    expected_k, expected_v = k_before.clone(), v_before.clone()
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        expected_k[slot // block_size, slot % block_size] = key[t]
        expected_v[slot // block_size, slot % block_size] = value[t]
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)
    written = (key_cache != k_before).any(-1).any(-1).sum().item()
    assert written == int((slot_mapping >= 0).sum())  # every real slot written, nothing else


def test_reshape_and_cache_all_pad_touches_nothing():
    g = torch.Generator().manual_seed(0)
    key_cache = _cache(3, 16, 2, 16, torch.float32, g)
    value_cache = _cache(3, 16, 2, 16, torch.float32, g)
    k_before, v_before = key_cache.clone(), value_cache.clone()
    key = randn_nonzero((4, 2, 16), torch.float32, g)
    reshape_and_cache(key, key.clone(), key_cache, value_cache,
                      torch.full((4,), PAD_SLOT_ID, dtype=torch.int64))
    assert torch.equal(key_cache, k_before) and torch.equal(value_cache, v_before)


def test_reshape_and_cache_zero_tokens():
    g = torch.Generator().manual_seed(0)
    key_cache = _cache(2, 16, 2, 16, torch.float32, g)
    before = key_cache.clone()
    empty = torch.zeros((0, 2, 16))
    reshape_and_cache(empty, empty, key_cache, key_cache.clone(), torch.zeros((0,), dtype=torch.int64))
    assert torch.equal(key_cache, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_reshape_and_cache_then_paged_attention(dtype):
    """End to end on a mixed batch with padded rows: writing the new tokens into a cache
    that holds only the context gives exactly the batch's cache, and attention over it
    matches the oracle."""
    batch = make_paged_batch([(0, 7), (20, 3), pad(1), (33, 1), (15, 0), (5, 18), pad(2)],
                             block_size=16, num_heads=4, num_kv_heads=2, head_size=16, dtype=dtype,
                             seed=4)
    key_cache, value_cache = batch.caches_before_write()
    assert not torch.equal(key_cache, batch.key_cache)
    reshape_and_cache(batch.key, batch.value, key_cache, value_cache, batch.slot_mapping)
    assert torch.equal(key_cache, batch.key_cache)
    assert torch.equal(value_cache, batch.value_cache)
    out = paged_attention(batch.query, key_cache, value_cache, batch.cu_seqlens_q, batch.seq_lens,
                          batch.block_table)
    assert_close_to_oracle(out, oracle_paged(*batch.attention_args()), dtype)
    assert bool((out[batch.pad_rows] == 0).all())


def test_reshape_and_cache_non_contiguous_key_value():
    """key/value often come out of a fused qkv projection as strided views."""
    g = torch.Generator().manual_seed(5)
    qkv = randn_nonzero((6, 3, 2, 16), torch.float32, g)
    key, value = qkv[:, 1], qkv[:, 2]
    assert not key.is_contiguous()
    key_cache = _cache(2, 16, 2, 16, torch.float32, g)
    value_cache = _cache(2, 16, 2, 16, torch.float32, g)
    slots = torch.tensor([3, 17, -1, 31, 0, 16], dtype=torch.int64)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(key_cache[s // 16, s % 16], key[t])
            assert torch.equal(value_cache[s // 16, s % 16], value[t])


# --- copy_blocks -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_layers", [1, 3])
def test_copy_blocks_several_layers_and_pairs(num_layers, dtype):
    g = torch.Generator().manual_seed(num_layers)
    num_blocks = 10
    key_caches = [_cache(num_blocks, 16, 2, 16, dtype, g) for _ in range(num_layers)]
    value_caches = [_cache(num_blocks, 16, 2, 16, dtype, g) for _ in range(num_layers)]
    before_k = [c.clone() for c in key_caches]
    before_v = [c.clone() for c in value_caches]
    # distinct destinations, sources disjoint from destinations, not sorted
    mapping = torch.tensor([[7, 2], [0, 9], [7, 4], [5, 1]], dtype=torch.int64)
    copy_blocks(key_caches, value_caches, mapping)
    for caches, befores in ((key_caches, before_k), (value_caches, before_v)):
        for cache, before in zip(caches, befores):
            expected = before.clone()
            for src, dst in mapping.tolist():
                expected[dst] = before[src]
            assert torch.equal(cache, expected)
    # layers stay distinct (no cross-layer mixing)
    if num_layers > 1:
        assert not torch.equal(key_caches[0][2], key_caches[1][2])


def test_copy_blocks_empty_mapping_is_noop():
    g = torch.Generator().manual_seed(1)
    kc, vc = [_cache(4, 16, 2, 16, torch.float32, g)], [_cache(4, 16, 2, 16, torch.float32, g)]
    before = (kc[0].clone(), vc[0].clone())
    copy_blocks(kc, vc, torch.zeros((0, 2), dtype=torch.int64))
    assert torch.equal(kc[0], before[0]) and torch.equal(vc[0], before[1])


def test_copy_blocks_rejects_bad_mapping():
    g = torch.Generator().manual_seed(1)
    kc, vc = [_cache(4, 16, 2, 16, torch.float32, g)], [_cache(4, 16, 2, 16, torch.float32, g)]
    with pytest.raises(ValueError, match="block_mapping"):
        copy_blocks(kc, vc, torch.tensor([[0, 4]], dtype=torch.int64))
    with pytest.raises(TypeError, match="block_mapping"):
        copy_blocks(kc, vc, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_mapping"):
        copy_blocks(kc, vc, torch.tensor([0, 1], dtype=torch.int64))
    with pytest.raises(ValueError, match="key_caches"):
        copy_blocks(kc, [], torch.tensor([[0, 1]], dtype=torch.int64))


# --- swap_blocks -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("src_blocks,dst_blocks", [(8, 5), (4, 12)])
def test_swap_blocks_cpu_to_cpu(src_blocks, dst_blocks, dtype):
    g = torch.Generator().manual_seed(src_blocks * 100 + dst_blocks)
    src = _cache(src_blocks, 16, 2, 16, dtype, g)
    dst = _cache(dst_blocks, 16, 2, 16, dtype, g)
    src_before, dst_before = src.clone(), dst.clone()
    pairs = [(src_blocks - 1, 0), (0, dst_blocks - 1), (2, 3)]
    mapping = torch.tensor(pairs, dtype=torch.int64)
    swap_blocks(src, dst, mapping)
    expected = dst_before.clone()
    for s, d in pairs:
        expected[d] = src_before[s]
    assert torch.equal(dst, expected)
    assert torch.equal(src, src_before)  # the source is only read


def test_swap_blocks_rejects_mismatch():
    g = torch.Generator().manual_seed(2)
    src = _cache(4, 16, 2, 16, torch.float32, g)
    with pytest.raises(TypeError, match="dtype"):
        swap_blocks(src, _cache(4, 16, 2, 16, torch.float16, g), torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="blocks differ"):
        swap_blocks(src, _cache(4, 32, 2, 16, torch.float32, g), torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="block_mapping"):
        swap_blocks(src, _cache(2, 16, 2, 16, torch.float32, g), torch.tensor([[3, 2]]))


def test_reshape_and_cache_strided_cache_view():
    """K and V halves of one combined ``[num_blocks, 2, block_size, Hkv, D]`` allocation are
    valid ``[num_blocks, block_size, Hkv, D]`` caches (paged_attention reads them). Writing
    them must either land in exactly the right slots or be refused up front with a
    ValueError naming the cache -- not crash inside the kernel (nor write to a copy)."""
    g = torch.Generator().manual_seed(6)
    kv = randn_nonzero((4, 2, 16, 2, 16), torch.float32, g)
    key_cache, value_cache = kv[:, 0], kv[:, 1]
    assert not key_cache.is_contiguous()
    before = kv.clone()
    key = randn_nonzero((3, 2, 16), torch.float32, g)
    value = randn_nonzero((3, 2, 16), torch.float32, g)
    slots = torch.tensor([0, 17, 63], dtype=torch.int64)
    try:
        reshape_and_cache(key, value, key_cache, value_cache, slots)
    except ValueError as e:
        assert "key_cache" in str(e) or "contiguous" in str(e)
        assert torch.equal(kv, before)
        return
    expected = before.clone()
    for t, s in enumerate(slots.tolist()):
        expected[s // 16, 0, s % 16] = key[t]
        expected[s // 16, 1, s % 16] = value[t]
    assert torch.equal(kv, expected)


def test_copy_blocks_refuses_repeated_destinations_and_mismatched_pairs():
    from compiled_attn.ops import copy_blocks

    k = torch.randn(6, 4, 2, 16)
    v = torch.randn(6, 4, 2, 16)
    with pytest.raises(ValueError, match="destinations must be distinct"):
        copy_blocks([k], [v], torch.tensor([[0, 3], [1, 3]]))
    with pytest.raises(ValueError, match="value_cache must match key_cache"):
        copy_blocks([k], [torch.randn(6, 4, 2, 8)], torch.tensor([[0, 3]]))


def test_copy_blocks_names_the_layer_whose_caches_disagree():
    keys = [torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8)]
    values = [torch.zeros(4, 2, 1, 8), torch.zeros(4, 3, 1, 8)]
    with pytest.raises(ValueError, match=r"layer 1 \(key_caches\[1\], value_caches\[1\]\)"):
        copy_blocks(keys, values, torch.tensor([[0, 1]]))
