"""Gradients of the varlen attention ops against autograd of an independent float64 naive."""

from __future__ import annotations

import pytest
import torch

from compiled_attn.ops import varlen_attention
from paged_batches import alibi_slopes, make_lambda, make_varlen_batch


def _naive(q, k, v, cu_q, cu_k, lam, scale, causal, window, softcap, slopes):
    """Differentiable float64 attention, one sequence at a time, dense explicit mask."""
    outs = []
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        def one(qh, kh, vv, sl):
            ql, kl = qh.shape[0], kh.shape[0]
            s = torch.einsum("qhd,khd->hqk", qh, kh.repeat_interleave(group, 1)) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            dist = (torch.arange(ql)[:, None] + kl - ql) - torch.arange(kl)[None, :]
            if sl is not None:
                s = s - sl[:, None, None] * dist.abs()
            ok = torch.ones_like(dist, dtype=torch.bool)
            if causal:
                ok &= dist >= 0
            if window[0] >= 0:
                ok &= dist <= window[0]
            if window[1] >= 0:
                ok &= dist >= -window[1]
            p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1)
            p = torch.where(ok.any(-1, keepdim=True), p, torch.zeros_like(p))
            return torch.einsum("hqk,khd->qhd", p, vv.repeat_interleave(group, 1))
        if lam is None:
            outs.append(one(qs, ks, vs, slopes))
        else:
            pair_v = torch.cat([vs[:, 0::2], vs[:, 1::2]], dim=-1)
            s1 = None if slopes is None else slopes[0::2]
            s2 = None if slopes is None else slopes[1::2]
            a1 = one(qs[:, 0::2], ks[:, 0::2], pair_v, s1)
            a2 = one(qs[:, 1::2], ks[:, 1::2], pair_v, s2)
            outs.append(a1 - lam.reshape(-1)[:, None] * a2)
    return torch.cat(outs)


CASES = {
    "causal": dict(causal=True, window=(-1, -1), softcap=0.0, alibi=False),
    "window-softcap": dict(causal=True, window=(3, 0), softcap=5.0, alibi=False),
    "cross-alibi": dict(causal=False, window=(-1, -1), softcap=0.0, alibi=True),
}


@pytest.mark.parametrize("head_size", [16, 72, 111])
@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("case", list(CASES))
def test_varlen_gradients_match_naive_float64(case, differential, head_size):
    opts = CASES[case]
    batch = make_varlen_batch([5, 1, 9], [5, 3, 9] if not opts["causal"] else None,
                              num_heads=4, num_kv_heads=2, head_size=head_size, seed=11)
    slopes = alibi_slopes(4) if opts["alibi"] else None
    lam = make_lambda(4, per_pair=True, seed=3) if differential else None
    leaves = [t.clone().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    lam_leaf = None if lam is None else lam.clone().requires_grad_()
    out = varlen_attention(*leaves, batch.cu_seqlens_q, batch.cu_seqlens_k, lam_leaf,
                           causal=opts["causal"], window_size=opts["window"], softcap=opts["softcap"],
                           alibi_slopes=slopes)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (out.double() * weights).sum().backward()

    ref_leaves = [t.detach().double().requires_grad_() for t in (batch.q, batch.k, batch.v)]
    ref_lam = None if lam is None else lam.detach().double().requires_grad_()
    ref = _naive(*ref_leaves, batch.cu_seqlens_q.tolist(), batch.cu_seqlens_k.tolist(), ref_lam,
                 head_size ** -0.5, opts["causal"], opts["window"], opts["softcap"],
                 None if slopes is None else slopes.double())
    (ref * weights).sum().backward()
    pairs = list(zip(leaves, ref_leaves)) + ([(lam_leaf, ref_lam)] if differential else [])
    for ours, theirs in pairs:
        assert ours.grad is not None and torch.isfinite(ours.grad).all()
        err = (ours.grad.double() - theirs.grad).norm() / theirs.grad.norm()
        assert err < 1e-5, err


def test_opcheck_covers_the_autograd_registration():
    batch = make_varlen_batch([4, 2], num_heads=4, num_kv_heads=2, head_size=16, seed=2)
    q, k, v = (t.clone().requires_grad_() for t in (batch.q, batch.k, batch.v))
    lam = make_lambda(4, per_pair=False).requires_grad_()
    args = (q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, lam, 0.25, True, -1, -1, 0.0, None, None)
    torch.library.opcheck(torch.ops.compiled_attn.varlen_attention.default, args)
    torch.library.opcheck(torch.ops.compiled_attn.varlen_attention.default, args[:5] + (None,) + args[6:])


def test_compiled_training_step_matches_eager():
    """torch.compile(fullgraph=True) of forward + backward through the differential op."""
    batch = make_varlen_batch([6, 3], num_heads=4, num_kv_heads=2, head_size=16, seed=4)
    lam = make_lambda(4, per_pair=False)

    def step(q, k, v, lam):
        out = varlen_attention(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k, lam)
        return (out ** 2).sum()

    grads = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (batch.q, batch.k, batch.v, lam)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
