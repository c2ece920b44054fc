"""``torch.library.opcheck`` on every ``compiled_attn`` op, several shape sets each.

opcheck runs, per call: ``test_schema`` (declared mutations/aliasing match what the kernel
does), ``test_autograd_registration``, ``test_faketensor`` (the fake impl's output matches
the real one in shape/dtype/strides), ``test_aot_dispatch_static`` and
``test_aot_dispatch_dynamic`` (the op traces through AOTAutograd with static and dynamic
shapes). The raw overloads ``torch.ops.compiled_attn.<name>.default`` are called with
positional arguments in schema order.
"""

from __future__ import annotations

import pytest
import torch

import compiled_attn  # noqa: F401

from paged_batches import alibi_slopes, make_lambda, make_paged_batch, make_varlen_batch, pad, randn_nonzero

ops = torch.ops.compiled_attn

# name -> (seqs, block_size, num_heads, num_kv_heads, head_size, dtype, options)
# options = (scale, causal, window_left, window_right, softcap, use_alibi); the op's last
# argument, scale_softcap, is None unless a test passes the tensor form.
PAGED_CASES = {
    "mha_causal": ([(0, 5), (7, 2), (9, 1)], 16, 2, 2, 16, torch.float32, (0.25, True, -1, -1, 0.0, False)),
    "gqa_alibi_window": ([(0, 9), (17, 3), (4, 0), (20, 1)], 16, 4, 2, 16, torch.float32,
                         (0.25, True, 6, -1, 0.0, True)),
    "mqa_noncausal_softcap_bf16": ([(3, 4), (30, 2)], 32, 4, 1, 32, torch.bfloat16,
                                   (0.2, False, 4, 2, 5.0, False)),
    "padded_rows_fp16": ([(5, 2), pad(1), (0, 3), pad(1)], 16, 4, 2, 16, torch.float16,
                         (0.25, True, -1, -1, 0.0, True)),
}
DIFF_PAGED_CASES = {
    "scalar_lambda": ([(0, 5), (7, 2), (9, 1)], 16, 4, 2, 16, torch.float32,
                      (0.25, True, -1, -1, 0.0, False), False),
    "per_pair_lambda_alibi": ([(0, 9), (17, 3), (20, 1)], 16, 8, 4, 16, torch.float32,
                              (0.25, True, 8, -1, 0.0, True), True),
    "per_pair_gqa4_softcap_bf16": ([(3, 4), (30, 2), pad(1)], 32, 8, 2, 16, torch.bfloat16,
                                   (0.2, False, -1, -1, 4.0, False), True),
}
VARLEN_CASES = {
    "self_causal": ([5, 1, 7], None, 2, 2, 16, torch.float32, (0.25, True, -1, -1, 0.0, False)),
    "gqa_cross_alibi": ([3, 0, 4], [6, 2, 4], 4, 2, 16, torch.float32, (0.25, False, -1, -1, 0.0, True)),
    "mqa_window_softcap_fp16": ([9, 4], [9, 6], 4, 1, 32, torch.float16, (0.2, True, 3, -1, 3.0, False)),
}
DIFF_VARLEN_CASES = {
    "scalar_lambda": ([5, 1, 7], None, 4, 2, 16, torch.float32, (0.25, True, -1, -1, 0.0, False), False),
    "per_pair_lambda_alibi_cross": ([3, 0, 4], [6, 2, 4], 8, 4, 16, torch.float32,
                                    (0.25, False, 2, 2, 0.0, True), True),
    "per_pair_gqa_bf16": ([9, 4], None, 8, 2, 16, torch.bfloat16, (0.2, True, -1, -1, 2.0, False), True),
}


def _options(options, num_heads, scale_softcap=None):
    scale, causal, left, right, softcap, use_alibi = options
    return (scale, causal, left, right, softcap, alibi_slopes(num_heads) if use_alibi else None, scale_softcap)


def _paged_args(seqs, block_size, num_heads, num_kv_heads, head_size, dtype, seed):
    b = make_paged_batch(seqs, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_size=head_size, dtype=dtype, seed=seed)
    return b.attention_args()


@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_opcheck_paged_attention(case):
    seqs, bs, h, hkv, d, dtype, options = PAGED_CASES[case]
    args = (*_paged_args(seqs, bs, h, hkv, d, dtype, 1), None, *_options(options, h))
    out = ops.paged_attention.default(*args)
    assert out.shape == args[0].shape and bool(torch.isfinite(out).all())
    torch.library.opcheck(ops.paged_attention.default, args)


@pytest.mark.parametrize("case", list(DIFF_PAGED_CASES))
def test_opcheck_differential_paged_attention(case):
    seqs, bs, h, hkv, d, dtype, options, per_pair = DIFF_PAGED_CASES[case]
    lam = make_lambda(h, per_pair)
    args = (*_paged_args(seqs, bs, h, hkv, d, dtype, 2), lam, *_options(options, h))
    out = ops.paged_attention.default(*args)
    assert out.shape == (args[0].shape[0], h // 2, 2 * d) and bool(torch.isfinite(out).all())
    torch.library.opcheck(ops.paged_attention.default, args)


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_opcheck_varlen_attention(case):
    q_lens, k_lens, h, hkv, d, dtype, options = VARLEN_CASES[case]
    b = make_varlen_batch(q_lens, k_lens, num_heads=h, num_kv_heads=hkv, head_size=d, dtype=dtype, seed=3)
    args = (*b.attention_args(), None, *_options(options, h))
    out = ops.varlen_attention.default(*args)
    assert out.shape == b.q.shape and bool(torch.isfinite(out).all())
    torch.library.opcheck(ops.varlen_attention.default, args)


@pytest.mark.parametrize("case", list(DIFF_VARLEN_CASES))
def test_opcheck_differential_varlen_attention(case):
    q_lens, k_lens, h, hkv, d, dtype, options, per_pair = DIFF_VARLEN_CASES[case]
    b = make_varlen_batch(q_lens, k_lens, num_heads=h, num_kv_heads=hkv, head_size=d, dtype=dtype, seed=4)
    args = (*b.attention_args(), make_lambda(h, per_pair), *_options(options, h))
    out = ops.varlen_attention.default(*args)
    assert out.shape == (b.q.shape[0], h // 2, 2 * d) and bool(torch.isfinite(out).all())
    torch.library.opcheck(ops.varlen_attention.default, args)


@pytest.mark.parametrize("dtype,block_size,heads,slots", [
    (torch.float32, 16, 2, [3, 17, -1, 40, 0]),
    (torch.bfloat16, 32, 1, [-1, -1]),
    (torch.float16, 16, 4, [47, 1, 2, 30, -1, 8, 9]),
], ids=["fp32", "bf16_all_pad", "fp16"])
def test_opcheck_reshape_and_cache(dtype, block_size, heads, slots):
    g = torch.Generator().manual_seed(len(slots))
    num_blocks = 3
    key_cache = randn_nonzero((num_blocks, block_size, heads, 16), dtype, g)
    value_cache = randn_nonzero((num_blocks, block_size, heads, 16), dtype, g)
    key = randn_nonzero((len(slots), heads, 16), dtype, g)
    value = randn_nonzero((len(slots), heads, 16), dtype, g)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    before = key_cache.clone()
    ops.reshape_and_cache.default(key, value, key_cache, value_cache, slot_mapping)
    for t, s in enumerate(slots):
        if s >= 0:
            assert torch.equal(key_cache[s // block_size, s % block_size], key[t])
            assert torch.equal(value_cache[s // block_size, s % block_size], value[t])
    assert bool((key_cache != before).any()) == any(s >= 0 for s in slots)
    torch.library.opcheck(ops.reshape_and_cache.default, (key, value, key_cache, value_cache, slot_mapping))


@pytest.mark.parametrize("num_layers,pairs", [(1, [[0, 1]]), (2, [[3, 0], [1, 2], [3, 4]])])
def test_opcheck_copy_blocks(num_layers, pairs):
    g = torch.Generator().manual_seed(num_layers)
    kc = [randn_nonzero((5, 16, 2, 16), torch.float32, g) for _ in range(num_layers)]
    vc = [randn_nonzero((5, 16, 2, 16), torch.float32, g) for _ in range(num_layers)]
    mapping = torch.tensor(pairs, dtype=torch.int64)
    src, dst = pairs[-1]
    ops.copy_blocks.default(kc, vc, mapping)
    assert torch.equal(kc[-1][dst], kc[-1][src]) and torch.equal(vc[0][dst], vc[0][src])
    torch.library.opcheck(ops.copy_blocks.default, (kc, vc, mapping))


@pytest.mark.parametrize("src_blocks,dst_blocks,dtype", [(4, 6, torch.float32), (6, 3, torch.bfloat16)])
def test_opcheck_swap_blocks(src_blocks, dst_blocks, dtype):
    g = torch.Generator().manual_seed(src_blocks)
    src = randn_nonzero((src_blocks, 16, 2, 16), dtype, g)
    dst = randn_nonzero((dst_blocks, 16, 2, 16), dtype, g)
    mapping = torch.tensor([[0, dst_blocks - 1], [src_blocks - 1, 0]], dtype=torch.int64)
    ops.swap_blocks.default(src, dst, mapping)
    assert torch.equal(dst[dst_blocks - 1], src[0]) and torch.equal(dst[0], src[src_blocks - 1])
    torch.library.opcheck(ops.swap_blocks.default, (src, dst, mapping))


# --- inputs that are not contiguous ----------------------------------------------------------
# The fake output must have the real output's strides. A query that is dense but not
# contiguous (e.g. ``x.transpose(0, 1)`` of a head-major ``[H, T, D]`` tensor) and a query
# that is a slice of a fused qkv projection are both legal inputs.


def _permuted(t: torch.Tensor) -> torch.Tensor:
    """Same values, dense, strides of a transposed ``[H, T, D]`` tensor."""
    out = t.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(out, t) and not out.is_contiguous()
    return out


def _qkv_slice(t: torch.Tensor) -> torch.Tensor:
    """Same values, a non-dense view (component 0 of a fused ``[T, 3, H, D]``)."""
    fused = torch.stack([t, torch.zeros_like(t), torch.zeros_like(t)], dim=1)
    out = fused[:, 0]
    assert torch.equal(out, t) and not out.is_contiguous()
    return out


LAYOUTS = {"permuted_query": _permuted, "qkv_slice_query": _qkv_slice}


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_opcheck_paged_attention_noncontiguous_query(layout, differential):
    query, *rest = _paged_args([(0, 5), (7, 2), (9, 1)], 16, 4, 2, 16, torch.float32, 5)
    query = LAYOUTS[layout](query)
    options = _options((0.25, True, -1, -1, 0.0, False), 4)
    op = ops.paged_attention.default
    args = (query, *rest, make_lambda(4, True) if differential else None, *options)
    expected = op(query.contiguous(), *args[1:])
    assert torch.equal(op(*args), expected)
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_opcheck_varlen_attention_noncontiguous_q(layout, differential):
    b = make_varlen_batch([5, 1, 7], None, num_heads=4, num_kv_heads=2, head_size=16, seed=6)
    q = LAYOUTS[layout](b.q)
    k, v = _qkv_slice(b.k), _qkv_slice(b.v)
    options = _options((0.25, True, -1, -1, 0.0, False), 4)
    op = ops.varlen_attention.default
    args = (q, k, v, b.cu_seqlens_q, b.cu_seqlens_k, make_lambda(4, False) if differential else None, *options)
    expected = op(b.q, b.k, b.v, *args[3:])
    assert torch.equal(op(*args), expected)
    torch.library.opcheck(op, args)


# --- scale and softcap as a tensor (the form traced per-call floats take) --------------------


@pytest.mark.parametrize("softcap", [0.0, 3.0], ids=["no_softcap", "softcap"])
@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_opcheck_scale_softcap_tensor_equals_floats(differential, softcap):
    """``scale_softcap`` carries the same values as the floats it replaces (which are then
    ignored; a softcap of 0 turns capping off)."""
    args = _paged_args([(0, 5), (17, 3), pad(1)], 16, 4, 2, 16, torch.float32, 7)
    lam = make_lambda(4, True) if differential else None
    expected = ops.paged_attention.default(*args, lam, *_options((0.3, True, -1, -1, softcap, True), 4))
    tensor_form = _options((1.0, True, -1, -1, 9.0, True), 4, torch.tensor([0.3, softcap]))
    got = ops.paged_attention.default(*args, lam, *tensor_form)
    torch.testing.assert_close(got, expected)
    torch.library.opcheck(ops.paged_attention.default, (*args, lam, *tensor_form))
    b = make_varlen_batch([5, 1, 7], [5, 3, 9], num_heads=4, num_kv_heads=2, head_size=16, seed=8)
    expected = ops.varlen_attention.default(*b.attention_args(), lam, *_options((0.3, False, -1, -1, softcap, False), 4))
    tensor_form = _options((1.0, False, -1, -1, 9.0, False), 4, torch.tensor([0.3, softcap]))
    torch.testing.assert_close(ops.varlen_attention.default(*b.attention_args(), lam, *tensor_form), expected)
    torch.library.opcheck(ops.varlen_attention.default, (*b.attention_args(), lam, *tensor_form))


# --- the backward op -------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["plain", "differential_per_pair", "differential_scalar_softcap_alibi"])
def test_opcheck_varlen_attention_backward(case):
    b = make_varlen_batch([5, 1, 7], [5, 3, 9], num_heads=4, num_kv_heads=2, head_size=16, seed=9)
    lam = {"plain": None, "differential_per_pair": make_lambda(4, True),
           "differential_scalar_softcap_alibi": make_lambda(4, False)}[case]
    options = (0.25, False, 3, -1, 2.0, True) if case.endswith("alibi") else (0.25, True, -1, -1, 0.0, False)
    args = (*b.attention_args(), lam, *_options(options, 4))
    out = ops.varlen_attention.default(*args)
    grad_out = randn_nonzero(out.shape, out.dtype, torch.Generator().manual_seed(10))
    dq, dk, dv, dlambda = ops.varlen_attention_backward.default(grad_out, *args)
    assert dq.shape == b.q.shape and dk.shape == b.k.shape and dv.shape == b.v.shape
    assert dlambda.shape == ((0,) if lam is None else lam.shape)
    assert all(bool(torch.isfinite(g).all()) and g.abs().sum() > 0 for g in (dq, dk, dv))
    torch.library.opcheck(ops.varlen_attention_backward.default, (grad_out, *args))
