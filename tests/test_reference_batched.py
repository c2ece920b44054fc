"""Edge cases of the batched CPU kernels in ``compiled_attn.ops.reference``.

``paged_attention`` and ``varlen_attention`` attend a whole batch at once (queries padded
to ``[B, max_q]``, keys gathered key-major up to the longest sequence, one mask), so the
cases that stress the padding and gathering get their own tests here: the kernels are
called directly (as ``torch.compile`` calls them, without the eager value checks of the
public ops) and compared with the independent float64 oracle of :mod:`oracle`.
"""

from __future__ import annotations

import pytest
import torch

from compiled_attn.ops import reference

from oracle import assert_close_to_oracle, oracle_paged, oracle_varlen
from paged_batches import alibi_slopes, make_lambda, make_paged_batch, make_varlen_batch, pad

# (num_heads, num_kv_heads): GQA ratio 1, 2 and 4, also in KV pairs for differential layers.
HEADS = [(4, 4), (8, 4), (16, 4)]
HEAD_IDS = ["ratio1", "ratio2", "ratio4"]

LAYOUTS = {
    "one_key": [(0, 1)],                              # a sequence of length 1
    "one_seq_prefill": [(0, 20)],                     # B = 1, queries a view, output permuted
    "decode_one_seq_partial_block": [(36, 1)],        # B = 1 path, last block partial
    "query_longer_than_block": [(5, 37), (0, 40)],   # q_len > block_size (16)
    "partial_last_blocks": [(0, 17), (30, 1), (15, 1), (16, 1)],
    "uniform_multi_token_with_padding": [(5, 3), pad(3)],  # queries a view; padded rows see nothing
    "padding_and_zero_queries": [(7, 0), pad(2), (9, 2), pad(1), (40, 0)],
    "longest_last": [(3, 1), pad(1), (0, 2), (70, 1)],
}


def _paged(batch, lambda_full=None, scale=None, causal=True, window=(-1, -1), softcap=0.0,
           alibi=None, block_table=None, query=None, caches=None):
    """(kernel output, oracle output) of one paged batch."""
    scale = batch.head_size ** -0.5 if scale is None else scale
    query = batch.query if query is None else query
    key_cache, value_cache = (batch.key_cache, batch.value_cache) if caches is None else caches
    table = batch.block_table if block_table is None else block_table
    out = reference.paged_attention(query, key_cache, value_cache, batch.cu_seqlens_q, batch.seq_lens,
                                    table, lambda_full, scale, causal, *window, softcap, alibi)
    expected = oracle_paged(batch.query, batch.key_cache, batch.value_cache, batch.cu_seqlens_q,
                            batch.seq_lens, batch.block_table, scale, causal, window, softcap, alibi,
                            lambda_full)
    return out, expected


def _varlen(batch, lambda_full=None, scale=None, causal=True, window=(-1, -1), softcap=0.0, alibi=None,
            qkv=None):
    scale = batch.head_size ** -0.5 if scale is None else scale
    q, k, v = (batch.q, batch.k, batch.v) if qkv is None else qkv
    out = reference.varlen_attention(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, lambda_full,
                                     scale, causal, *window, softcap, alibi)
    expected = oracle_varlen(batch.q, batch.k, batch.v, batch.cu_seqlens_q, batch.cu_seqlens_k, scale,
                             causal, window, softcap, alibi, lambda_full)
    return out, expected


def _check(out, expected, dtype, zero_rows=()):
    assert out.is_contiguous()
    assert_close_to_oracle(out, expected, dtype)
    if zero_rows:
        assert bool((out[list(zero_rows)] == 0).all()), "rows that see no key must be exact zeros"


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_paged_layouts_with_nan_garbage(layout, heads, differential):
    """Every slot no sequence owns (tails of last blocks, spare blocks) is NaN."""
    num_heads, num_kv_heads = heads
    batch = make_paged_batch(LAYOUTS[layout], block_size=16, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_size=16, unused_fill="nan", seed=len(layout))
    lam = make_lambda(num_heads, per_pair=True) if differential else None
    for causal in (True, False):
        out, expected = _paged(batch, lam, causal=causal, alibi=alibi_slopes(num_heads))
        _check(out, expected, torch.float32, batch.pad_rows)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_paged_garbage_block_ids_past_used_blocks(num_seqs, differential):
    """Table columns past a sequence's last block may hold any int32 (out of range,
    negative): they are never read."""
    seqs = [(20, 1), (3, 2), pad(1)][:num_seqs]
    batch = make_paged_batch(seqs, block_size=16, head_size=16, extra_columns=3, unused_fill="nan", seed=4)
    table = batch.block_table.clone()
    garbage = torch.tensor([10**9, -7, batch.num_blocks, 2**31 - 1, -(2**31)], dtype=torch.int32)
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        used = -(-seq_len // 16)
        table[b, used:] = garbage[torch.arange(table.shape[1] - used) % len(garbage)]
    lam = make_lambda(4, per_pair=False) if differential else None
    clean, expected = _paged(batch, lam)
    dirty, _ = _paged(batch, lam, block_table=table)
    assert torch.equal(clean, dirty)
    _check(dirty, expected, torch.float32, batch.pad_rows)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_window_hides_every_key(differential):
    """Rows whose window (or bottom-right causal mask) holds no key are exact zeros."""
    batch = make_varlen_batch([6, 3], [2, 5], num_heads=4, num_kv_heads=2, head_size=16, seed=9)
    lam = make_lambda(4, per_pair=True) if differential else None
    # non-causal window (0, 1): query i of sequence 0 sits at key i - 4, sees keys [i - 4, i - 3]
    out, expected = _varlen(batch, lam, causal=False, window=(0, 1))
    _check(out, expected, torch.float32, zero_rows=[0, 1, 2])
    # causal: queries 0..3 of sequence 0 sit before key 0
    out, expected = _varlen(batch, lam, causal=True, window=(1, -1))
    _check(out, expected, torch.float32, zero_rows=[0, 1, 2, 3])
    assert bool((out[4:].abs().sum(-1) > 0).all())


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_softcap_alibi_window_together(differential, causal):
    batch = make_paged_batch([(0, 7), pad(1), (37, 5), (15, 0), (50, 1), (20, 3)], block_size=16,
                             num_heads=8, num_kv_heads=4, head_size=32, value_scale=2.0, seed=5)
    lam = make_lambda(8, per_pair=True) if differential else None
    window = (16, -1) if causal else (6, 4)
    out, expected = _paged(batch, lam, scale=0.4, causal=causal, window=window, softcap=3.0,
                           alibi=alibi_slopes(8))
    _check(out, expected, torch.float32, batch.pad_rows)
    vb = batch.to_varlen()
    out, expected = _varlen(vb, lam, scale=0.4, causal=causal, window=window, softcap=3.0,
                            alibi=alibi_slopes(8))
    _check(out, expected, torch.float32)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_float64_stays_float64(differential):
    batch = make_paged_batch([(20, 3), pad(1), (0, 18), (33, 1)], block_size=16, head_size=16,
                             dtype=torch.float64, seed=6)
    lam = make_lambda(4, per_pair=True).double() if differential else None
    for out, expected in (_paged(batch, lam, alibi=alibi_slopes(4), softcap=2.0),
                          _varlen(batch.to_varlen(), lam, causal=False, window=(3, 2))):
        assert out.dtype == torch.float64 and out.is_contiguous()
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_low_precision_inputs(differential, dtype):
    batch = make_paged_batch([(20, 3), pad(2), (0, 18), (33, 1), (70, 1)], block_size=16, head_size=32,
                             num_heads=8, num_kv_heads=2, dtype=dtype, unused_fill="nan", seed=7)
    lam = make_lambda(8, per_pair=False).to(dtype) if differential else None
    out, expected = _paged(batch, lam, alibi=alibi_slopes(8))
    assert out.dtype == dtype
    _check(out, expected, dtype, batch.pad_rows)
    out, expected = _varlen(batch.to_varlen(), lam, window=(9, -1))
    _check(out, expected, dtype)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_strided_inputs(differential):
    """Queries sliced out of a fused projection, caches that are views of bigger tensors
    (one whose blocks cannot be flattened into slots without a copy), strided k/v."""
    g = torch.Generator().manual_seed(8)
    batch = make_paged_batch([(20, 3), (5, 1), pad(1), (40, 2)], block_size=16, num_heads=4,
                             num_kv_heads=2, head_size=16, unused_fill="nan", seed=8)
    lam = make_lambda(4, per_pair=True) if differential else None
    num_tokens = batch.num_tokens
    fused = torch.randn(num_tokens, 6 * 16, generator=g)
    fused[:, :64] = batch.query.flatten(1)
    query = fused[:, :64].view(num_tokens, 4, 16)
    wide = torch.randn(batch.num_blocks, 16, 4, 16, generator=g)  # [.., 2 * Hkv, ..]: heads 0-1
    wide[:, :, :2] = batch.key_cache
    tall = torch.randn(batch.num_blocks, 17, 2, 16, generator=g)  # 17 slots a block: not flattenable
    tall[:, :16] = batch.value_cache
    caches = (wide[:, :, :2], tall[:, :16])
    assert not query.is_contiguous() and not any(c.is_contiguous() for c in caches)
    out, expected = _paged(batch, lam, query=query, caches=caches, causal=False)
    _check(out, expected, torch.float32, batch.pad_rows)

    vb = make_varlen_batch([5, 1, 9], [7, 4, 9], num_heads=4, num_kv_heads=2, head_size=16, seed=8)
    q_t = vb.q.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D] with heads outermost
    k_t = torch.stack([vb.k, vb.k], dim=-1)[..., 0]            # last dim stride 2
    v_t = vb.v.transpose(0, 1).contiguous().transpose(0, 1)
    assert not (q_t.is_contiguous() or k_t.is_contiguous() or v_t.is_contiguous())
    out, expected = _varlen(vb, lam, qkv=(q_t, k_t, v_t), alibi=alibi_slopes(4))
    _check(out, expected, torch.float32)


def test_output_is_a_new_tensor():
    """Even when the queries are read as a view (one query per sequence, plain heads)."""
    batch = make_paged_batch([(30, 1)], block_size=16, num_heads=4, num_kv_heads=4, head_size=16, seed=10)
    out, _ = _paged(batch)
    assert out.is_contiguous() and out.untyped_storage().data_ptr() != batch.query.untyped_storage().data_ptr()
    before = batch.query.clone()
    out.add_(1.0)
    assert torch.equal(batch.query, before)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("contexts", [[8], [299], [8, 17, 31, 64, 100, 150, 220, 299]],
                         ids=["B1_ctx8", "B1_ctx300", "B8_ctx8-300"])
def test_engine_decode_shapes(contexts, differential):
    """The decode steps of the CPU engine: Hq 8, Hkv 4, D 32, a wide block table of zeros
    past each sequence's blocks, one query per sequence."""
    batch = make_paged_batch([(c, 1) for c in contexts], block_size=16, num_heads=8, num_kv_heads=4,
                             head_size=32, extra_columns=0, spare_blocks=1, seed=len(contexts))
    table = torch.zeros(len(contexts), 256, dtype=torch.int32)
    table[:, : batch.block_table.shape[1]] = batch.block_table
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        table[b, -(-seq_len // 16):] = 0
    lam = make_lambda(8, per_pair=True) if differential else None
    out, expected = _paged(batch, lam, block_table=table)
    _check(out, expected, torch.float32)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_varlen_gradients(differential):
    """The varlen backward op differentiates this kernel (``torch.func.vjp``): its
    gradients, through the padding, gathering and masks, match finite differences."""
    g = torch.Generator().manual_seed(11)
    q_lens, k_lens = [3, 1, 0, 4], [3, 5, 2, 2]
    cu_q = torch.tensor([0, 3, 4, 4, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 8, 10, 12], dtype=torch.int32)
    assert cu_q.diff().tolist() == q_lens and cu_k.diff().tolist() == k_lens
    q = torch.randn(8, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(12, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(12, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    inputs = [q, k, v]
    if differential:
        inputs.append(torch.tensor([0.3, 0.6], dtype=torch.float64, requires_grad=True))
    slopes = alibi_slopes(4)

    def f(q, k, v, *lam):
        return reference.varlen_attention(q, k, v, cu_q, cu_k, *(lam or (None,)), 0.5, True, 2, -1, 4.0, slopes)

    assert torch.autograd.gradcheck(f, inputs)
    _, vjp = torch.func.vjp(f, *inputs)
    grads = vjp(torch.ones_like(f(*inputs)))
    assert len(grads) == len(inputs) and all(bool(torch.isfinite(x).all()) for x in grads)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_rows_past_the_last_sequence_are_zeros(differential):
    """A query buffer padded past ``cu_seqlens_q[-1]`` (a static shape; eager checks reject
    it, unchecked calls reach the kernel): the real rows as without the padding, the padded
    rows zeros, for both kernels."""
    batch = make_varlen_batch([3, 5, 1], num_heads=8, num_kv_heads=4, seed=4)
    lam = make_lambda(8, per_pair=True) if differential else None
    padding = torch.randn(4, *batch.q.shape[1:], dtype=batch.q.dtype)  # garbage rows, not zeros
    padded = torch.cat((batch.q, padding))
    out, expected = _varlen(batch, lam, qkv=(padded, batch.k, batch.v))
    assert out.shape[0] == padded.shape[0]
    assert_close_to_oracle(out[: batch.q.shape[0]], expected)
    assert bool((out[batch.q.shape[0]:] == 0).all())
    paged = make_paged_batch([(6, 3), (0, 2)], num_heads=8, num_kv_heads=4, seed=5)
    query = torch.cat((paged.query, torch.randn(3, *paged.query.shape[1:], dtype=paged.query.dtype)))
    out, expected = _paged(paged, lam, query=query)
    assert_close_to_oracle(out[: paged.query.shape[0]], expected)
    assert bool((out[paged.query.shape[0]:] == 0).all())
