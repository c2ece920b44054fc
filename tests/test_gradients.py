"""Explicit gradients (``ops/gradients.py``) and FLOP formulas (``ops/flops.py``).

Attention gradients are compared against float64 autograd through the independent oracle
(:func:`oracle.oracle_varlen`, never ``ops/reference``) and against finite differences of the
oracle (``torch.autograd.gradcheck``). The oracle detaches its inputs and reads ``lambda_full``
as Python floats so that it always returns plain values; to differentiate it we run it under a
``TorchFunctionMode`` that makes ``Tensor.detach`` the identity (nothing else changes), and get
``dλ`` from the fact that the output is affine in ``λ`` (``out(λ) = a1 - λ a2``, so
``a2 = out(0) - out(1)`` exactly). ``fused_linear`` gradients are compared against float64
autograd of the plain PyTorch composition. Both must run unchanged under ``FlopCounterMode``
and any ``TorchDispatchMode`` (the fault of the ``torch.func.vjp`` backward this replaces), and
as the kernel of a custom backward op that passes ``opcheck``.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from oracle import oracle_varlen
from paged_batches import randn_nonzero

from compiled_attn.ops import flops
from compiled_attn.ops.gradients import fused_linear_backward, varlen_attention_backward

HEAD_SIZE = 8
SCALE = 0.4  # not head_size ** -0.5, so a kernel that ignores `scale` fails

# (q_len, k_len) per sequence: equal lengths, a one-token query against 4 keys, more queries
# than keys (causal rows 0..2 see no key), a sequence with no query, a query with no key at
# all (its rows see no key), a sequence of length 1, a longer one.
LENGTHS = [(3, 3), (1, 4), (5, 2), (0, 6), (2, 0), (1, 1), (6, 6)]

OPTIONS = {
    "causal": dict(causal=True, window=(-1, -1), softcap=0.0, alibi=False),
    "noncausal": dict(causal=False, window=(-1, -1), softcap=0.0, alibi=False),
    "window": dict(causal=True, window=(2, 0), softcap=0.0, alibi=False),
    "softcap": dict(causal=True, window=(-1, -1), softcap=1.5, alibi=False),
    "alibi": dict(causal=False, window=(-1, -1), softcap=0.0, alibi=True),
    "window2-softcap-alibi": dict(causal=False, window=(2, 1), softcap=2.0, alibi=True),
}


# --- helpers ----------------------------------------------------------------------------------


class _Passthrough(TorchDispatchMode):
    """The most trivial dispatch mode: run every op as is."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _DifferentiableDetach(TorchFunctionMode):
    """``Tensor.detach`` becomes the identity, so autograd flows through the oracle."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.detach:
            return args[0]
        return func(*args, **(kwargs or {}))


def _seed(*parts):
    """A per-case seed that does not depend on PYTHONHASHSEED."""
    return zlib.crc32(repr(parts).encode())


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _attention_case(seed, num_heads, num_kv_heads, lengths=LENGTHS, dtype=torch.float64,
                    lambda_kind=None, alibi=False):
    """Fresh random (nonzero) inputs of one test case."""
    g = torch.Generator().manual_seed(seed)
    q_lens, k_lens = zip(*lengths)
    q = randn_nonzero((sum(q_lens), num_heads, HEAD_SIZE), torch.float64, g).to(dtype)
    k = randn_nonzero((sum(k_lens), num_kv_heads, HEAD_SIZE), torch.float64, g).to(dtype)
    v = randn_nonzero((sum(k_lens), num_kv_heads, HEAD_SIZE), torch.float64, g).to(dtype)
    if lambda_kind is None:
        lam = None
    else:
        shape = () if lambda_kind == "0d" else (num_heads // 2,)
        lam = 0.2 + 0.7 * torch.rand(shape, generator=g, dtype=torch.float64)
        lam = lam.to(torch.float64 if dtype == torch.float64 else torch.float32)
    slopes = (0.05 + 0.5 * torch.rand(num_heads, generator=g)).float() if alibi else None
    out_shape = (q.shape[0], num_heads // 2, 2 * HEAD_SIZE) if lam is not None else q.shape
    grad_out = randn_nonzero(out_shape, torch.float64, g).to(dtype)
    return dict(grad_out=grad_out, q=q, k=k, v=v, cu_seqlens_q=_cu(q_lens), cu_seqlens_k=_cu(k_lens),
                lambda_full=lam, alibi_slopes=slopes)


def _ours(case, opts, **overrides):
    c = {**case, **overrides}
    return varlen_attention_backward(
        c["grad_out"], c["q"], c["k"], c["v"], c["cu_seqlens_q"], c["cu_seqlens_k"], c["lambda_full"],
        SCALE, opts["causal"], opts["window"][0], opts["window"][1], opts["softcap"], c["alibi_slopes"])


def _oracle_forward(q, k, v, case, opts, lambda_full):
    return oracle_varlen(q, k, v, case["cu_seqlens_q"], case["cu_seqlens_k"], scale=SCALE,
                         causal=opts["causal"], window=opts["window"], softcap=opts["softcap"],
                         alibi_slopes=case["alibi_slopes"], lambda_full=lambda_full)


def _oracle_grads(case, opts):
    """float64 ``(dq, dk, dv, dlambda)`` by autograd through the oracle (see module docstring)."""
    leaves = [case[n].detach().double().requires_grad_() for n in ("q", "k", "v")]
    lam = case["lambda_full"]
    with _DifferentiableDetach():
        out = _oracle_forward(*leaves, case, opts, lam)
    grad_out = case["grad_out"].double()
    dq, dk, dv = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    dq, dk, dv = (torch.zeros_like(x) if d is None else d for d, x in zip((dq, dk, dv), leaves))
    if lam is None:
        return dq, dk, dv, None
    pairs = case["q"].shape[1] // 2
    ones = torch.ones(pairs, dtype=torch.float64)
    a2 = (_oracle_forward(*leaves, case, opts, 0 * ones) - _oracle_forward(*leaves, case, opts, ones)).detach()
    dlam = -(grad_out * a2).sum(dim=(0, 2))  # per pair
    return dq, dk, dv, dlam.sum() if lam.dim() == 0 else dlam


def _assert_tight(got, expected, what, tol=1e-10):
    """Max abs error within ``tol * max(1, max |expected|)``: gradcheck-level for float64."""
    assert got.dtype == torch.float64 and got.shape == expected.shape, what
    bound = tol * max(1.0, expected.abs().max().item())
    err = (got - expected).abs().max().item() if got.numel() else 0.0
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def _assert_close(got, expected, what, rel_l2, max_abs):
    """Relative L2 error and max abs error (relative to ``max(1, max |expected|)``)."""
    got, expected = got.double(), expected.double()
    assert got.shape == expected.shape, what
    assert torch.isfinite(got).all(), f"{what}: non-finite"
    rel = ((got - expected).norm() / expected.norm().clamp_min(1e-300)).item()
    err = (got - expected).abs().max().item()
    assert rel < rel_l2, f"{what}: relative L2 error {rel:.3g} >= {rel_l2:g}"
    assert err <= max_abs * max(1.0, expected.abs().max().item()), f"{what}: max abs error {err:.3g}"


ATTENTION_CASES = [
    pytest.param(differential, ratio, option, lam,
                 id=f"{'diff-' + lam if differential else 'plain'}-gqa{ratio}-{option}")
    for differential in (False, True)
    for ratio in (1, 2, 4)
    for option in OPTIONS
    for lam in (("0d", "pairs") if differential else (None,))
]


def _heads(differential, ratio):
    num_heads = 8 if differential else 4
    return num_heads, num_heads // ratio


# --- attention: against the oracle ----------------------------------------------------------


@pytest.mark.parametrize("differential,ratio,option,lam", ATTENTION_CASES)
def test_attention_backward_matches_oracle_autograd_float64(differential, ratio, option, lam):
    opts = OPTIONS[option]
    num_heads, num_kv_heads = _heads(differential, ratio)
    seed = _seed(differential, ratio, option, lam)
    case = _attention_case(seed, num_heads, num_kv_heads, lambda_kind=lam, alibi=opts["alibi"])
    dq, dk, dv, dlam = _ours(case, opts)
    eq, ek, ev, elam = _oracle_grads(case, opts)
    for name, got, expected in (("dq", dq, eq), ("dk", dk, ek), ("dv", dv, ev)):
        _assert_tight(got, expected, name)
    if differential:
        lam_in = case["lambda_full"]
        assert dlam.shape == lam_in.shape and dlam.dtype == lam_in.dtype
        _assert_tight(dlam, elam, "dlambda")
    else:
        assert dlam.shape == (0,) and dlam.dtype == case["q"].dtype
    # The gradients are not trivially zero (the case exercises every input)...
    assert dq.abs().sum() > 0 and dk.abs().sum() > 0 and dv.abs().sum() > 0
    # ...and exactly zero where no key is seen / no query looks.
    cu_q, cu_k = case["cu_seqlens_q"].tolist(), case["cu_seqlens_k"].tolist()
    assert (dq[cu_q[4]:cu_q[5]] == 0).all()  # (2, 0): no key at all
    assert (dk[cu_k[3]:cu_k[4]] == 0).all() and (dv[cu_k[3]:cu_k[4]] == 0).all()  # (0, 6): no query
    if opts["causal"]:
        assert (dq[cu_q[2]:cu_q[2] + 3] == 0).all()  # (5, 2): causal rows 0..2 see no key


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_attention_backward_low_precision_dtypes(differential, dtype):
    opts = OPTIONS["window2-softcap-alibi"]
    num_heads, num_kv_heads = _heads(differential, 2)
    case = _attention_case(7, num_heads, num_kv_heads, dtype=dtype,
                           lambda_kind="pairs" if differential else None, alibi=True)
    grads = _ours(case, opts)
    expected = _oracle_grads(case, opts)  # float64 math on the same (rounded) inputs
    tol = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1e-2)}[dtype]
    for name, got, exp, like in zip(("dq", "dk", "dv"), grads, expected, ("q", "k", "v")):
        assert got.dtype == dtype and got.shape == case[like].shape, name
        _assert_close(got, exp, name, *tol)
    if differential:
        assert grads[3].dtype == torch.float32
        _assert_close(grads[3], expected[3], "dlambda", 1e-5, 1e-5)


class _OracleWithOurBackward(torch.autograd.Function):
    """Forward: the oracle. Backward: :func:`varlen_attention_backward`. gradcheck compares the
    backward against finite differences of the (unmodified) oracle."""

    @staticmethod
    def forward(ctx, q, k, v, lam, case, opts):
        ctx.save_for_backward(q, k, v, lam)
        ctx.case, ctx.opts = case, opts
        return _oracle_forward(q, k, v, case, opts, lam)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, lam = ctx.saved_tensors
        dq, dk, dv, dlam = _ours(ctx.case, ctx.opts, grad_out=grad_out, q=q, k=k, v=v, lambda_full=lam)
        return dq, dk, dv, (dlam if lam is not None else None), None, None


@pytest.mark.parametrize("differential,ratio,option,lam", [
    (False, 2, "window2-softcap-alibi", None),
    (False, 4, "causal", None),
    (True, 1, "softcap", "pairs"),
    (True, 2, "window2-softcap-alibi", "0d"),
], ids=["plain-gqa2-all", "plain-mqa-causal", "diff-pairs-softcap", "diff-0d-gqa2-all"])
def test_attention_backward_gradcheck_against_oracle(differential, ratio, option, lam):
    opts = OPTIONS[option]
    num_heads = 4
    num_kv_heads = num_heads // ratio if not differential else max(2, num_heads // ratio)
    case = _attention_case(13, num_heads, num_kv_heads, lengths=[(2, 2), (1, 3), (3, 1), (2, 0)],
                           lambda_kind=lam, alibi=opts["alibi"])
    inputs = [case["q"].requires_grad_(), case["k"].requires_grad_(), case["v"].requires_grad_()]
    lam_t = None if lam is None else case["lambda_full"].double().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, k, v, lam: _OracleWithOurBackward.apply(q, k, v, lam, case, opts),
        (*inputs, lam_t), eps=1e-6, atol=1e-7, rtol=1e-6)


# --- attention: under dispatch modes ---------------------------------------------------------


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("mode", [lambda: FlopCounterMode(display=False), _Passthrough],
                         ids=["FlopCounterMode", "TorchDispatchMode"])
def test_attention_backward_under_dispatch_mode(differential, mode):
    opts = OPTIONS["window2-softcap-alibi"]
    case = _attention_case(21, *_heads(differential, 2), dtype=torch.float32,
                           lambda_kind="pairs" if differential else None, alibi=True)
    expected = _ours(case, opts)
    with mode():
        got = _ours(case, opts)
    for name, a, b in zip(("dq", "dk", "dv", "dlambda"), got, expected):
        assert torch.equal(a, b), name


def test_attention_backward_no_query_and_no_sequence():
    opts = OPTIONS["causal"]
    for lengths in ([(0, 3), (0, 2)], []):
        case = _attention_case(3, 4, 2, lengths=lengths or [(0, 0)], lambda_kind="0d")
        if not lengths:
            case["cu_seqlens_q"] = case["cu_seqlens_k"] = torch.zeros(1, dtype=torch.int32)
        dq, dk, dv, dlam = _ours(case, opts)
        assert dq.shape == case["q"].shape and dk.shape == case["k"].shape
        assert not dk.abs().sum() and not dv.abs().sum() and dlam.shape == () and dlam == 0


# --- attention: as the kernel of a custom backward op (the case's reproduction) ----------------

def _op_args(case, opts):
    return (case["q"], case["k"], case["v"], case["cu_seqlens_q"], case["cu_seqlens_k"], case["lambda_full"],
            SCALE, opts["causal"], *opts["window"], opts["softcap"], case["alibi_slopes"], None)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_varlen_op_under_flop_counter_counts_and_matches(differential):
    """The op's forward and backward under ``FlopCounterMode``: gradients bit-equal to a run
    without the mode, close to the oracle's, and both ops counted."""
    opts = OPTIONS["causal"]
    case = _attention_case(5, *_heads(differential, 2), dtype=torch.float32,
                           lambda_kind="pairs" if differential else None)
    op = torch.ops.compiled_attn.varlen_attention

    def run(mode):
        leaves = [case[n].clone().requires_grad_() for n in ("q", "k", "v")]
        lam = None if case["lambda_full"] is None else case["lambda_full"].clone().requires_grad_()
        args = _op_args({**case, "q": leaves[0], "k": leaves[1], "v": leaves[2], "lambda_full": lam}, opts)
        with mode:
            (op(*args) * case["grad_out"]).sum().backward()
        return [t.grad for t in (*leaves, lam) if t is not None]

    counter = FlopCounterMode(display=False)
    got = run(counter)
    expected = run(_Passthrough())
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    oracle = _oracle_grads(case, opts)
    for a, b in zip(got, oracle):
        _assert_close(a, b, "grad", 1e-5, 1e-5)

    counts = counter.get_flop_counts()["Global"]
    pairs = sum(q_len * k_len for q_len, k_len in LENGTHS)
    num_heads = case["q"].shape[1]
    forward = (12 * (num_heads // 2) if differential else 4 * num_heads) * pairs * HEAD_SIZE
    assert counts[torch.ops.compiled_attn.varlen_attention] == forward
    assert counts[torch.ops.compiled_attn.varlen_attention_backward] == forward * 5 // 2


# --- FLOP formulas against hand counts ------------------------------------------------------


def _varlen_tensors(q_lens, k_lens, num_heads, num_kv_heads, head_size=16):
    q = torch.empty(sum(q_lens), num_heads, head_size)
    k = torch.empty(sum(k_lens), num_kv_heads, head_size)
    return q, k, torch.empty_like(k), _cu(q_lens), _cu(k_lens)


def test_varlen_flops_hand_counts():
    q, k, v, cu_q, cu_k = _varlen_tensors([3, 1, 5, 0, 4], [3, 4, 2, 6, 4], 8, 2)
    # Σ q_len * k_len = 9 + 4 + 10 + 0 + 16 = 39
    assert flops.varlen_attention_flops(q, k, v, cu_q, cu_k) == 4 * 8 * 39 * 16 == 19968
    assert flops.varlen_attention_flops(q, k, v, cu_q, cu_k, None, 0.25, True) == 19968
    lam = torch.tensor(0.5)
    assert flops.varlen_attention_flops(q, k, v, cu_q, cu_k, lam) == 12 * 4 * 39 * 16 == 29952
    assert flops.varlen_attention_flops(q, k, v, cu_q, cu_k, torch.rand(4)) == 29952
    grad_out = torch.empty_like(q)
    assert flops.varlen_attention_backward_flops(grad_out, q, k, v, cu_q, cu_k, None) == 10 * 8 * 39 * 16
    grad_out = torch.empty(q.shape[0], 4, 32)
    assert flops.varlen_attention_backward_flops(grad_out, q, k, v, cu_q, cu_k, lam) == 30 * 4 * 39 * 16


def test_varlen_flops_agree_with_torch_sdpa_count():
    q_lens, k_lens = [3, 7, 1], [5, 7, 9]
    q, k, v, cu_q, cu_k = _varlen_tensors(q_lens, k_lens, 6, 3)
    forward = sum(sdpa_flop_count((1, 6, a, 16), (1, 3, b, 16), (1, 3, b, 16)) for a, b in zip(q_lens, k_lens))
    backward = sum(sdpa_backward_flop_count((1, 6, a, 16), (1, 6, a, 16), (1, 3, b, 16), (1, 3, b, 16))
                   for a, b in zip(q_lens, k_lens))
    assert flops.varlen_attention_flops(q, k, v, cu_q, cu_k) == forward
    assert flops.varlen_attention_backward_flops(torch.empty_like(q), q, k, v, cu_q, cu_k) == backward


def test_paged_flops_hand_counts():
    query = torch.empty(9, 4, 16)  # cu_seqlens_q [0, 3, 4, 9, 9]: q_lens 3, 1, 5, 0 (a padded row)
    key_cache = torch.empty(10, 8, 2, 16)
    cu_q = torch.tensor([0, 3, 4, 9, 9], dtype=torch.int32)
    seq_lens = torch.tensor([5, 17, 9, 0], dtype=torch.int32)
    block_table = torch.zeros(4, 3, dtype=torch.int32)
    pairs = 3 * 5 + 1 * 17 + 5 * 9  # = 77
    args = (query, key_cache, key_cache, cu_q, seq_lens, block_table)
    assert flops.paged_attention_flops(*args) == 4 * 4 * pairs * 16 == 19712
    assert flops.paged_attention_flops(*args, None, 0.25, True) == 19712
    assert flops.paged_attention_flops(*args, torch.rand(2), 0.25, True) == 12 * 2 * pairs * 16


def test_flops_with_fake_tensors_use_dense_bound():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(12, 4, 16)
        k = torch.empty(20, 2, 16)
        cu = torch.zeros(4, dtype=torch.int32)
        assert flops.varlen_attention_flops(q, k, k, cu, cu) == 4 * 4 * 12 * 20 * 16
        assert flops.varlen_attention_flops(q, k, k, cu, cu, torch.rand(())) == 12 * 2 * 12 * 20 * 16
        key_cache = torch.empty(10, 8, 2, 16)
        block_table = torch.zeros(3, 5, dtype=torch.int32)
        seq_lens = torch.zeros(3, dtype=torch.int32)
        assert flops.paged_attention_flops(q, key_cache, key_cache, cu, seq_lens, block_table) == \
            4 * 4 * 12 * (5 * 8) * 16


def test_fused_linear_flops_hand_count():
    x, w = torch.empty(5, 16), torch.empty(24, 16)
    assert flops.fused_linear_flops(x, w, None, None, 1e-6, None, False) == 2 * 5 * 16 * 24 == 3840
    assert flops.fused_linear_flops(x, w, torch.empty(24), torch.empty(16), 1e-6, torch.empty(5, 12), True) == 3840
    # the same count torch gives the plain GEMM
    with FlopCounterMode(display=False) as counter:
        F.linear(torch.randn(5, 16), torch.randn(24, 16), torch.randn(24))
    assert counter.get_total_flops() == 3840


# --- fused_linear ---------------------------------------------------------------------------------

IN, OUT, TOKENS, EPS = 12, 10, 5, 1e-5
FEATURES = list(itertools.product([False, True], repeat=4))  # bias, norm, residual, silu_and_mul


def _feature_id(features):
    names = ("bias", "norm", "residual", "silu")
    return "-".join(n for n, on in zip(names, features) if on) or "bare"


def _linear_case(seed, features, dtype=torch.float64):
    has_bias, has_norm, has_residual, silu = features
    g = torch.Generator().manual_seed(seed)
    rows = 2 * OUT if silu else OUT

    def rand(*shape, scale=1.0):
        return randn_nonzero(shape, torch.float64, g, scale).to(dtype)

    return dict(
        x=rand(TOKENS, IN), weight=rand(rows, IN, scale=0.3), bias=rand(rows) if has_bias else None,
        norm_weight=(1 + 0.3 * rand(IN)) if has_norm else None, residual=rand(TOKENS, OUT) if has_residual else None,
        silu_and_mul=silu, grad_out=rand(TOKENS, OUT))


_LINEAR_INPUTS = ("x", "weight", "bias", "norm_weight", "residual")


def _composition(x, weight, bias, norm_weight, residual, silu_and_mul):
    """The unfused PyTorch code fused_linear stands for."""
    h = x
    if norm_weight is not None:
        h = norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))
    y = F.linear(h, weight, bias)
    if silu_and_mul:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


def _linear_expected(case):
    leaves = {n: (None if case[n] is None else case[n].detach().double().requires_grad_()) for n in _LINEAR_INPUTS}
    out = _composition(**leaves, silu_and_mul=case["silu_and_mul"])
    present = [t for t in leaves.values() if t is not None]
    grads = iter(torch.autograd.grad(out, present, case["grad_out"].double()))
    return [None if t is None else next(grads) for t in leaves.values()]


def _linear_ours(case, needs=(True,) * 5):
    return fused_linear_backward(case["grad_out"], case["x"], case["weight"], case["bias"], case["norm_weight"],
                                 EPS, case["residual"], case["silu_and_mul"], needs)


@pytest.mark.parametrize("features", FEATURES, ids=_feature_id)
def test_fused_linear_backward_matches_autograd_float64(features):
    case = _linear_case(_seed(features), features)
    for name, got, expected in zip(_LINEAR_INPUTS, _linear_ours(case), _linear_expected(case)):
        if expected is None:
            assert got is None, name
        else:
            assert got.shape == case[name].shape and got.abs().sum() > 0, name
            _assert_tight(got, expected, name)


@pytest.mark.parametrize("features", [(True, True, True, True), (False, True, False, True), (True, False, True, False)],
                         ids=_feature_id)
def test_fused_linear_backward_needs_input_grad_subsets(features):
    case = _linear_case(3, features)
    full = _linear_ours(case)
    for needs in itertools.product([False, True], repeat=5):
        got = _linear_ours(case, needs)
        # the op's ctx.needs_input_grad has 7 entries (norm_eps and silu_and_mul in between)
        got7 = _linear_ours(case, (*needs[:4], False, needs[4], False))
        for name, want, g, g7, f in zip(_LINEAR_INPUTS, needs, got, got7, full):
            if want and case[name] is not None:
                assert torch.equal(g, f) and torch.equal(g7, f), (name, needs)
            else:
                assert g is None and g7 is None, (name, needs)
    with pytest.raises(ValueError):
        _linear_ours(case, (True, True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("features", [(True, True, True, True), (False, False, False, False)], ids=_feature_id)
def test_fused_linear_backward_low_precision(dtype, features):
    case = _linear_case(11, features, dtype)
    tol = {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2)}[dtype]
    for name, got, expected in zip(_LINEAR_INPUTS, _linear_ours(case), _linear_expected(case)):
        if expected is not None:
            assert got.dtype == dtype, name
            _assert_close(got, expected, name, *tol)


@pytest.mark.parametrize("mode", [lambda: FlopCounterMode(display=False), _Passthrough],
                         ids=["FlopCounterMode", "TorchDispatchMode"])
def test_fused_linear_backward_under_dispatch_mode(mode):
    case = _linear_case(17, (True, True, True, True), torch.float32)
    expected = _linear_ours(case)
    with mode():
        got = _linear_ours(case)
    for name, a, b in zip(_LINEAR_INPUTS, got, expected):
        assert torch.equal(a, b), name
