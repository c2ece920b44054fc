"""Paged and varlen attention, plain and differential, against the float64 oracle.

Every case builds a fresh random batch (fixed seed) with :mod:`paged_batches`, runs the
public op (``compiled_attn.ops.paged_attention`` / ``varlen_attention``) and compares
every output element with :mod:`oracle` (independent of ``ops/reference.py``):
fp32 within 1e-5 relative L2 (and 1e-5 per element), fp16/bf16 within 1e-2 relative L2.
The ops return fresh tensors, so instead of poisoning an ``out`` buffer every element is
checked to be finite and compared, padded rows must be exact zeros, and the unused cache
slots are filled with random garbage (or NaN) that must not leak into the result.
"""

from __future__ import annotations

import pytest
import torch

import compiled_attn  # noqa: F401  (registers the ops)
from compiled_attn.ops import paged_attention, varlen_attention

from oracle import assert_close_to_oracle, oracle_paged, oracle_varlen
from paged_batches import alibi_slopes, make_lambda, make_paged_batch, make_varlen_batch, pad

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]

# Batches mixing every kind of chunk: prefill (context 0), chunked prefill / prefix hit,
# decode, multi-token decode, a sequence of length 1, a sequence with no query this step
# in the middle, a query longer than a block (40 > 32), full and partial last blocks.
MIXED = [(0, 20), (37, 5), (50, 1), (20, 3), (15, 0), (0, 1), (33, 40), (30, 2), (62, 4)]
MIXED_PADDED = [(0, 7), pad(1), (37, 5), (15, 0), (50, 1), (20, 3), pad(2), (0, 1), pad(1)]
LAYOUTS = {
    "mixed": MIXED,
    "mixed_padded": MIXED_PADDED,
    "prefill_only": [(0, 45), (0, 1), (0, 16), (0, 33), (0, 32)],
    "decode_only": [(63, 1), (64, 1), (0, 1), (31, 1), (15, 1), (16, 1), (1, 1)],
    "multi_token_decode": [(17, 4), (5, 2), (31, 3), (32, 4), (0, 2)],
    "chunked_prefill": [(16, 16), (40, 24), (3, 29), (64, 33)],
    "single_seq_len1": [(0, 1)],
    "zero_query_first_and_last": [(12, 0), (9, 3), (40, 0)],
    "padding_only": [pad(1), pad(3)],
}

# name -> (wrapper kwargs, oracle kwargs); every option of the contract, alone and combined.
OPTIONS = {
    "causal": ({}, {}),
    "noncausal": ({"causal": False}, {"causal": False}),
    "scale": ({"scale": 0.3}, {"scale": 0.3}),
    "window_left": ({"window_size": (8, -1)}, {"window": (8, -1)}),
    "window_left0": ({"window_size": (0, -1)}, {"window": (0, -1)}),
    "window_left_right_noncausal": ({"causal": False, "window_size": (6, 4)},
                                    {"causal": False, "window": (6, 4)}),
    "window_right_noncausal": ({"causal": False, "window_size": (-1, 3)},
                               {"causal": False, "window": (-1, 3)}),
    "window_causal_with_right": ({"window_size": (5, 2)}, {"window": (5, 2)}),
    "softcap": ({"softcap": 2.0, "scale": 0.5}, {"softcap": 2.0, "scale": 0.5}),
    "alibi": ({"alibi_slopes": "alibi"}, {"alibi_slopes": "alibi"}),
    "alibi_noncausal": ({"alibi_slopes": "alibi", "causal": False},
                        {"alibi_slopes": "alibi", "causal": False}),
    "all": ({"alibi_slopes": "alibi", "softcap": 3.0, "window_size": (16, -1), "scale": 0.4},
            {"alibi_slopes": "alibi", "softcap": 3.0, "window": (16, -1), "scale": 0.4}),
}


# (block size, dtype) pairs crossed with every option: both block sizes in fp32, each
# low-precision dtype at one block size (block size and dtype do not interact in the math).
PAGED_CONFIGS = [(16, torch.float32), (32, torch.float32), (16, torch.float16), (32, torch.bfloat16)]
PAGED_CONFIG_IDS = ["bs16-fp32", "bs32-fp32", "bs16-fp16", "bs32-bf16"]
# Differential: lambda as a 0-d tensor and per pair [H/2], each at every dtype.
DIFF_PAGED_CONFIGS = [(16, torch.float32, False), (32, torch.float32, True),
                      (16, torch.float16, True), (32, torch.bfloat16, False)]
DIFF_PAGED_CONFIG_IDS = ["bs16-fp32-lambda0d", "bs32-fp32-lambda_per_pair",
                         "bs16-fp16-lambda_per_pair", "bs32-bf16-lambda0d"]
VARLEN_CONFIGS = [("self", torch.float32), ("cross", torch.float32), ("self", torch.bfloat16),
                  ("cross", torch.float16)]
VARLEN_CONFIG_IDS = ["self-fp32", "cross-fp32", "self-bf16", "cross-fp16"]
DIFF_VARLEN_CONFIGS = [("self", torch.float32, True), ("cross", torch.float32, False),
                       ("self", torch.bfloat16, True), ("cross", torch.float16, False)]
DIFF_VARLEN_CONFIG_IDS = ["self-fp32-lambda_per_pair", "cross-fp32-lambda0d",
                          "self-bf16-lambda_per_pair", "cross-fp16-lambda0d"]


def _resolve(option: str, num_heads: int):
    kw, okw = (dict(d) for d in OPTIONS[option])
    for d in (kw, okw):
        if d.get("alibi_slopes") == "alibi":
            d["alibi_slopes"] = alibi_slopes(num_heads)
    return kw, okw


def _seed(*parts) -> int:
    """A fixed seed per test case (stable across runs and processes)."""
    text = "/".join(str(p) for p in parts)
    return sum((i + 1) * ord(c) for i, c in enumerate(text)) % (2**31)


def _snapshot(*tensors):
    return [t.clone() for t in tensors]


def _assert_unchanged(before, after):
    for b, a in zip(before, after):
        assert torch.equal(b, a) or torch.equal(torch.isnan(b), torch.isnan(a)) and torch.equal(
            torch.nan_to_num(b), torch.nan_to_num(a)), "an input tensor was modified"


def _check_paged(batch, option="causal", lambda_full=None):
    kw, okw = _resolve(option, batch.num_heads)
    before = _snapshot(*batch.attention_args())
    out = paged_attention(*batch.attention_args(), lambda_full, **kw)
    _assert_unchanged(before, batch.attention_args())
    expected = oracle_paged(*batch.attention_args(), lambda_full=lambda_full, **okw)
    assert_close_to_oracle(out, expected, batch.dtype)
    if batch.pad_rows:
        rows = out[batch.pad_rows]
        assert bool((rows == 0).all()), "padded rows (seq_len 0) must be exact zeros"
    return out


def _check_varlen(batch, option="causal", lambda_full=None):
    kw, okw = _resolve(option, batch.num_heads)
    before = _snapshot(*batch.attention_args())
    out = varlen_attention(*batch.attention_args(), lambda_full, **kw)
    _assert_unchanged(before, batch.attention_args())
    expected = oracle_varlen(*batch.attention_args(), lambda_full=lambda_full, **okw)
    assert_close_to_oracle(out, expected, batch.dtype)
    if batch.empty_rows:
        assert bool((out[batch.empty_rows] == 0).all()), "rows with no key must be exact zeros"
    return out


# --- the helpers themselves --------------------------------------------------------------


def test_batch_helper_cache_holds_each_sequence():
    """The paged cache, read through block_table, holds exactly each sequence's keys, the
    block ids are a non-contiguous permutation, and no random value is zero."""
    from oracle import gather_paged

    batch = make_paged_batch(MIXED_PADDED, block_size=16, num_heads=4, num_kv_heads=2,
                             head_size=16, seed=3)
    for b in range(batch.num_seqs):
        seq_len = int(batch.seq_lens[b])
        assert torch.equal(gather_paged(batch.key_cache, batch.block_table[b], seq_len), batch.keys[b])
        assert torch.equal(gather_paged(batch.value_cache, batch.block_table[b], seq_len), batch.values[b])
    used = [int(x) for b in range(batch.num_seqs)
            for x in batch.block_table[b, : -(-int(batch.seq_lens[b]) // 16)]]
    assert len(set(used)) == len(used)
    assert used != sorted(used)
    assert bool((batch.key_cache != 0).all()) and bool((batch.query != 0).all())
    assert batch.block_table.dtype == torch.int32 and batch.seq_lens.dtype == torch.int32
    assert batch.cu_seqlens_q.dtype == torch.int32 and batch.slot_mapping.dtype == torch.int64
    assert batch.block_table.shape[1] == 4 + 2  # ceil(55/16) = 4 blocks + 2 padding columns
    assert batch.pad_rows == [7, 17, 18, 20]
    assert (batch.slot_mapping[batch.pad_rows] == -1).all()
    assert batch.cu_seqlens_q.tolist()[-1] == batch.query.shape[0] == batch.key.shape[0]
    moved = batch.to("cpu")
    assert torch.equal(moved.key_cache, batch.key_cache) and torch.equal(moved.keys[2], batch.keys[2])


def test_oracle_itself_on_hand_computed_cases():
    """Pin the oracle's conventions with values computed by hand."""
    from oracle import oracle_attention, oracle_differential, visibility_mask

    # bottom-right causal alignment: 2 queries, 4 keys -> query 0 sits at key 2
    assert visibility_mask(2, 4, True, (-1, -1)) == [[True, True, True, False], [True] * 4]
    # window (1, 1), non-causal, q_len == k_len == 3
    assert visibility_mask(3, 3, False, (1, 1)) == [[True, True, False], [True, True, True],
                                                    [False, True, True]]
    # causal with q_len > k_len: the first query sees nothing
    assert visibility_mask(3, 2, True, (-1, -1)) == [[False, False], [True, False], [True, True]]
    # one query, two keys with scores 0 and log(3) -> weights 1/4, 3/4
    q = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)
    k = torch.tensor([[[0.0, 0.0]], [[torch.log(torch.tensor(3.0)).item(), 0.0]]], dtype=torch.float64)
    v = torch.tensor([[[4.0, 0.0]], [[0.0, 8.0]]], dtype=torch.float64)
    out = oracle_attention(q, k, v, scale=1.0, causal=False)
    torch.testing.assert_close(out, torch.tensor([[[1.0, 6.0]]], dtype=torch.float64))
    # ALiBi (slope ln 3): key 0 (score ln 3) is at distance 1, key 1 (score 0) at distance 0
    # -> both end at 0 -> equal weights
    out = oracle_attention(q, k.flip(0), v, 1.0, causal=True, alibi_slopes=torch.tensor([torch.log(torch.tensor(3.0)).item()]))
    torch.testing.assert_close(out, torch.tensor([[[2.0, 4.0]]], dtype=torch.float64))
    # softcap: score log(3) capped to c * tanh(log(3) / c)
    c = 0.5
    capped = c * torch.tanh(torch.log(torch.tensor(3.0, dtype=torch.float64)) / c)
    w1 = torch.exp(capped) / (1 + torch.exp(capped))
    out = oracle_attention(q, k, v, 1.0, causal=False, softcap=c)
    torch.testing.assert_close(out[0, 0], torch.stack([4 * (1 - w1), 8 * w1]))
    # differential: pair (q1, q2) over keys (k1, k2) and V = [v1, v2]; lambda 0.5
    qd = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)      # q1 peaks, q2 uniform
    kd = torch.stack([torch.tensor([[0.0, 0.0], [0.0, 0.0]]),
                      torch.tensor([[torch.log(torch.tensor(3.0)).item(), 0.0], [5.0, 5.0]])]).double()
    vd = torch.stack([torch.tensor([[1.0, 0.0], [0.0, 2.0]]),
                      torch.tensor([[3.0, 0.0], [0.0, 4.0]])]).double()
    out = oracle_differential(qd, kd, vd, 0.5, scale=1.0, causal=False)
    v_cat = torch.tensor([[1.0, 0.0, 0.0, 2.0], [3.0, 0.0, 0.0, 4.0]], dtype=torch.float64)
    a1 = torch.tensor([0.25, 0.75], dtype=torch.float64) @ v_cat
    a2 = torch.tensor([0.5, 0.5], dtype=torch.float64) @ v_cat
    torch.testing.assert_close(out[0, 0], a1 - 0.5 * a2)


def test_paged_block_table_exactly_full():
    """The longest sequence uses every block_table column (no padding columns)."""
    batch = make_paged_batch([(63, 1), (30, 2), (0, 64)], block_size=16, num_heads=4,
                             num_kv_heads=2, head_size=16, extra_columns=0, seed=13)
    assert batch.block_table.shape[1] * 16 == 64
    _check_paged(batch)
    _check_paged(batch, "causal", make_lambda(4, per_pair=True))


# --- paged, plain --------------------------------------------------------------------------


@pytest.mark.parametrize("block_size,dtype", PAGED_CONFIGS, ids=PAGED_CONFIG_IDS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_paged_options(option, block_size, dtype):
    batch = make_paged_batch(MIXED_PADDED if block_size == 16 else MIXED, block_size=block_size,
                             num_heads=4, num_kv_heads=2, head_size=32, dtype=dtype,
                             seed=_seed("paged", option, block_size, dtype))
    _check_paged(batch, option)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (16, 2), (4, 1), (8, 1)],
                         ids=["mha", "gqa2", "gqa4", "gqa8", "mqa4", "mqa8"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_gqa(heads, block_size, dtype):
    num_heads, num_kv_heads = heads
    batch = make_paged_batch(MIXED_PADDED, block_size=block_size, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_size=16, dtype=dtype,
                             seed=_seed("gqa", heads, block_size, dtype))
    _check_paged(batch, "alibi")  # per-head slopes also pin down the head -> KV head map


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_paged_layouts(layout, block_size):
    batch = make_paged_batch(LAYOUTS[layout], block_size=block_size, num_heads=4, num_kv_heads=2,
                             head_size=32, seed=_seed("layout", layout, block_size))
    _check_paged(batch)
    _check_paged(batch, "noncausal")


@pytest.mark.parametrize("option", ["causal", "noncausal", "alibi", "window_left_right_noncausal"])
def test_paged_padded_rows_are_exact_zeros(option):
    batch = make_paged_batch([pad(2), (10, 3), pad(1), (0, 5), pad(4)], block_size=16,
                             num_heads=4, num_kv_heads=2, head_size=16, seed=_seed("pad", option))
    out = _check_paged(batch, option)
    assert len(batch.pad_rows) == 7
    assert bool((out[batch.pad_rows] == 0).all())
    real = [t for t in range(batch.num_tokens) if t not in batch.pad_rows]
    assert bool((out[real].abs().sum(-1) > 0).all()), "real rows must not be zero"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("differential", [False, True])
def test_paged_unused_cache_slots_nan_do_not_leak(differential, dtype):
    """NaN in every cache slot no sequence owns (tails of last blocks, spare blocks) must
    not reach the output; the block_table padding columns point at those blocks too."""
    batch = make_paged_batch(MIXED_PADDED, block_size=16, num_heads=4, num_kv_heads=2,
                             head_size=16, dtype=dtype, unused_fill="nan",
                             seed=_seed("nan", differential, dtype))
    assert bool(torch.isnan(batch.key_cache).any())
    lam = make_lambda(4, per_pair=True) if differential else None
    _check_paged(batch, "alibi", lam)


def test_paged_block_table_padding_columns_ignored():
    batch = make_paged_batch(MIXED, block_size=16, num_heads=4, num_kv_heads=2, head_size=16,
                             seed=11)
    out = paged_attention(*batch.attention_args())
    table = batch.block_table.clone()
    for b in range(batch.num_seqs):
        used = -(-int(batch.seq_lens[b]) // 16)
        table[b, used:] = (table[b, used:] + 1) % batch.num_blocks
    out2 = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.cu_seqlens_q,
                           batch.seq_lens, table)
    assert torch.equal(out, out2)


@pytest.mark.parametrize("differential", [False, True])
def test_paged_matches_varlen_on_same_keys(differential):
    """Paged attention over the cache == varlen attention over the same keys, contiguous."""
    batch = make_paged_batch(MIXED, block_size=16, num_heads=4, num_kv_heads=2, head_size=32,
                             seed=_seed("pv", differential))
    lam = make_lambda(4, per_pair=False) if differential else None
    paged = paged_attention(*batch.attention_args(), lam, window_size=(10, -1))
    varlen = varlen_attention(*batch.to_varlen().attention_args(), lam, window_size=(10, -1))
    torch.testing.assert_close(paged, varlen, rtol=1e-6, atol=1e-6)


def test_paged_scale_default_is_head_size_rsqrt():
    batch = make_paged_batch([(5, 3), (0, 4)], head_size=32, seed=5)
    out = paged_attention(*batch.attention_args())
    explicit = paged_attention(*batch.attention_args(), scale=32 ** -0.5)
    assert torch.equal(out, explicit)
    other = paged_attention(*batch.attention_args(), scale=1.0)
    assert not torch.allclose(out, other)


# --- paged, differential -----------------------------------------------------------------


@pytest.mark.parametrize("block_size,dtype,per_pair", DIFF_PAGED_CONFIGS, ids=DIFF_PAGED_CONFIG_IDS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_differential_paged_options(option, block_size, dtype, per_pair):
    batch = make_paged_batch(MIXED_PADDED if block_size == 16 else MIXED, block_size=block_size,
                             num_heads=8, num_kv_heads=4, head_size=16, dtype=dtype,
                             seed=_seed("dpaged", option, block_size, dtype, per_pair))
    lam = make_lambda(8, per_pair, seed=_seed(option))
    assert lam.dim() == (1 if per_pair else 0)
    out = _check_paged(batch, option, lam)
    assert out.shape == (batch.num_tokens, 4, 32)


@pytest.mark.parametrize("per_pair", [False, True], ids=["lambda0d", "lambda_per_pair"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (16, 2), (8, 4)],
                         ids=["ratio1", "ratio2", "ratio4", "ratio8", "ratio2_2kvpairs"])
def test_differential_paged_gqa(heads, dtype, per_pair):
    num_heads, num_kv_heads = heads
    batch = make_paged_batch(MIXED_PADDED, block_size=16, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_size=16, dtype=dtype,
                             seed=_seed("dgqa", heads, dtype, per_pair))
    _check_paged(batch, "alibi", make_lambda(num_heads, per_pair, seed=num_heads))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_differential_paged_layouts(layout):
    batch = make_paged_batch(LAYOUTS[layout], block_size=32, num_heads=4, num_kv_heads=2,
                             head_size=32, seed=_seed("dlayout", layout))
    _check_paged(batch, "causal", make_lambda(4, per_pair=True))


def test_differential_lambda_in_query_dtype_and_lambda_zero():
    batch = make_paged_batch(MIXED, block_size=16, num_heads=4, num_kv_heads=2, head_size=16,
                             dtype=torch.bfloat16, seed=21)
    lam = torch.tensor([0.5, 0.75], dtype=torch.bfloat16)
    _check_paged(batch, "causal", lam)
    # lambda = 0: the output of pair j is plain attention of head 2j over [v1, v2].
    zero = paged_attention(*batch.attention_args(), torch.zeros(()))
    expected = oracle_paged(*batch.attention_args(), lambda_full=torch.zeros(()))
    assert_close_to_oracle(zero, expected)


def test_differential_per_pair_lambda_is_applied_per_pair():
    """Swapping the two per-pair lambdas must change exactly the two pairs' outputs."""
    batch = make_paged_batch([(9, 4), (0, 6)], num_heads=4, num_kv_heads=2, head_size=16, seed=8)
    a = paged_attention(*batch.attention_args(), torch.tensor([0.2, 0.9]))
    b = paged_attention(*batch.attention_args(), torch.tensor([0.9, 0.2]))
    assert not torch.allclose(a[:, 0], b[:, 0]) and not torch.allclose(a[:, 1], b[:, 1])
    c = paged_attention(*batch.attention_args(), torch.tensor(0.2))
    torch.testing.assert_close(a[:, 0], c[:, 0])


# --- varlen --------------------------------------------------------------------------------

VARLEN_LAYOUTS = {
    # self-attention (prefill / training): one zero-length sequence in the middle
    "self": ([17, 1, 40, 0, 5, 33], None),
    # cross-attention / bottom-right alignment: q_len != k_len both ways, a k_len 0 row
    "cross": ([3, 10, 1, 7, 0, 4, 6], [20, 4, 9, 7, 5, 0, 6]),
    "single": ([1], [1]),
    "decode_like": ([1, 1, 2, 4], [30, 1, 17, 4]),
}


def _varlen_batch(layout, num_heads, num_kv_heads, head_size, dtype, seed):
    q_lens, k_lens = VARLEN_LAYOUTS[layout]
    return make_varlen_batch(q_lens, k_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=dtype, seed=seed)


@pytest.mark.parametrize("layout,dtype", VARLEN_CONFIGS, ids=VARLEN_CONFIG_IDS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_varlen_options(option, layout, dtype):
    batch = _varlen_batch(layout, 4, 2, 32, dtype, _seed("varlen", option, layout, dtype))
    _check_varlen(batch, option)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (16, 2), (4, 1), (8, 1)],
                         ids=["mha", "gqa2", "gqa4", "gqa8", "mqa4", "mqa8"])
def test_varlen_gqa(heads, dtype):
    batch = _varlen_batch("cross", *heads, 16, dtype, _seed("vgqa", heads, dtype))
    _check_varlen(batch, "alibi")


@pytest.mark.parametrize("layout", list(VARLEN_LAYOUTS))
def test_varlen_layouts(layout):
    batch = _varlen_batch(layout, 4, 2, 32, torch.float32, _seed("vlayout", layout))
    _check_varlen(batch)
    _check_varlen(batch, "noncausal")


def test_varlen_causal_query_longer_than_keys_gives_zero_top_rows():
    """Bottom-right alignment: with q_len 6 > k_len 4, causal, queries 0 and 1 see no key."""
    batch = make_varlen_batch([6], [4], num_heads=2, num_kv_heads=2, head_size=16, seed=2)
    out = _check_varlen(batch)
    assert bool((out[:2] == 0).all())
    assert bool((out[2:].abs().sum(-1) > 0).all())


@pytest.mark.parametrize("layout,dtype,per_pair", DIFF_VARLEN_CONFIGS, ids=DIFF_VARLEN_CONFIG_IDS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_differential_varlen_options(option, layout, dtype, per_pair):
    batch = _varlen_batch(layout, 4, 2, 16, dtype, _seed("dvarlen", option, layout, dtype, per_pair))
    out = _check_varlen(batch, option, make_lambda(4, per_pair, seed=_seed(layout)))
    assert out.shape == (batch.q.shape[0], 2, 32)


@pytest.mark.parametrize("per_pair", [False, True], ids=["lambda0d", "lambda_per_pair"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (16, 2)],
                         ids=["ratio1", "ratio2", "ratio4", "ratio8"])
def test_differential_varlen_gqa(heads, dtype, per_pair):
    batch = _varlen_batch("self", *heads, 16, dtype, _seed("dvgqa", heads, dtype, per_pair))
    _check_varlen(batch, "alibi", make_lambda(heads[0], per_pair, seed=3))


# --- any head size from 1 to 256 (as flash-attn), not only multiples of 8 ----------------------


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("head_size", [1, 3, 72, 111, 256])
def test_any_head_size(head_size, differential):
    """Paged (padded rows, every option, GQA) and varlen cross-attention (float16)."""
    lam = make_lambda(8, per_pair=True, seed=head_size) if differential else None
    paged = make_paged_batch(MIXED_PADDED, block_size=16, num_heads=8, num_kv_heads=2, head_size=head_size,
                             seed=_seed("head_size", head_size), unused_fill="nan")
    out = _check_paged(paged, "all", lambda_full=lam)
    assert out.shape[-1] == (2 * head_size if differential else head_size)
    varlen = _varlen_batch("cross", 8, 2, head_size, torch.float16, _seed("vhead_size", head_size))
    _check_varlen(varlen, "noncausal", lambda_full=lam)


# --- degenerate batches and strided inputs ---------------------------------------------------


@pytest.mark.parametrize("differential", [False, True])
def test_empty_batches(differential):
    """Zero sequences / zero tokens: empty output of the right shape, no error."""
    lam = torch.tensor(0.5) if differential else None
    width = 32 if differential else 16
    pb = make_paged_batch([], block_size=16, num_heads=4, num_kv_heads=2, head_size=16, seed=0)
    assert pb.query.shape[0] == 0 and pb.cu_seqlens_q.tolist() == [0]
    out = paged_attention(*pb.attention_args(), lam)
    assert out.shape == (0, 2 if differential else 4, width) and out.dtype == torch.float32
    vb = make_varlen_batch([], [], num_heads=4, num_kv_heads=2, head_size=16, seed=0)
    out = varlen_attention(*vb.attention_args(), lam)
    assert out.shape == (0, 2 if differential else 4, width)
    # sequences present, but none has a query this step
    pb = make_paged_batch([(7, 0), (20, 0)], block_size=16, num_heads=4, num_kv_heads=2,
                          head_size=16, seed=1)
    out = paged_attention(*pb.attention_args(), lam)
    assert out.shape[0] == 0


@pytest.mark.parametrize("differential", [False, True])
def test_varlen_fused_qkv_views(differential):
    """q/k/v as strided views of one fused projection (the training / prefill layout)."""
    g = torch.Generator().manual_seed(31)
    num_heads, num_kv_heads, head_size = 4, 2, 16
    q_lens = [9, 1, 14]
    total = sum(q_lens)
    fused = torch.randn(total, (num_heads + 2 * num_kv_heads) * head_size, generator=g)
    q, k, v = fused.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], -1)
    q = q.view(total, num_heads, head_size)
    k = k.view(total, num_kv_heads, head_size)
    v = v.view(total, num_kv_heads, head_size)
    assert not q.is_contiguous() and not k.is_contiguous()
    cu = torch.tensor([0, 9, 10, 24], dtype=torch.int32)
    lam = make_lambda(num_heads, per_pair=True) if differential else None
    out = varlen_attention(q, k, v, cu, cu, lam, alibi_slopes=alibi_slopes(num_heads))
    expected = oracle_varlen(q, k, v, cu, cu, alibi_slopes=alibi_slopes(num_heads), lambda_full=lam)
    assert_close_to_oracle(out, expected, torch.float32)
