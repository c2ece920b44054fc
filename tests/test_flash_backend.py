"""The flash-attn backend of ``varlen_attention`` and ``paged_attention`` with stand-in
``flash_attn`` modules.

No flash-attn builds here, so stand-in modules (``flash_attn.cute`` for flash-attn 4,
``flash_attn_interface`` for flash-attn 3, ``flash_attn`` for flash-attn 2) record each call
and compute it with the float64 oracle of ``tests/oracle.py``, honouring only the arguments
flash-attn documents (so a wrong mapping of scale, causal, window, softcap, page table or
key lengths gives a wrong result); CPU tensors pose as CUDA ones (:class:`CudaLooking`).
Paged: prefill-bearing calls (``T > B``) of plain attention go to flash-attn 4 with
``page_table=block_table``, ``seqused_k=seq_lens`` and no ``cu_seqlens_k``, equal to the
oracle over a cache with NaN in its unused slots; decode (``T == B``), differential, fp8
caches, ALiBi, traced scalars, other block sizes, flash-attn 2/3 and :func:`disabled` stay
on our kernel, which gets the call unchanged. Varlen: which library is found,
which calls the backend takes (plain, but for batches of many short causal sequences, which
stay on our Gluon kernel; differential as two calls with a ``2 * D`` value head on
flash-attn 4 only; never ALiBi or traced scalars), the arguments passed, and results equal
to the oracle's for plain and differential attention (the differential pairs as views, no
copies); the one-pass combine kernel of the two calls (bit-identical to the eager float32
expression, close to the float64 formula; under Triton's interpreter without a GPU); and
``flash_backend.disabled()`` routing calls to our kernel, as the benchmark's TTFT rows use it.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from oracle import assert_close_to_oracle, oracle_attention, oracle_paged, oracle_varlen
from paged_batches import make_paged_batch, pad, randn_nonzero

from compiled_attn.ops import flash_backend


def stand_in(version: int, calls: list):
    """A flash_attn_varlen_func that computes with the oracle (float64) and records its kwargs.

    Version 4 also reads a paged cache as flash-attn 4 does: ``page_table`` ``[B, max_pages]``
    int32 with ``seqused_k`` ``[B]`` (keys per sequence) and no ``cu_seqlens_k``; k and v are
    then ``[num_pages, page_size, Hkv, D]`` and sequence ``b``'s keys are the first
    ``seqused_k[b]`` rows of its pages, in order."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, **rest):
        calls.append(dict(shapes=(tuple(q.shape), tuple(k.shape), tuple(v.shape)),
                          data_ptrs=(q.data_ptr(), k.data_ptr(), v.data_ptr()), max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k, scale=softmax_scale, causal=causal, window=window_size,
                          softcap=softcap, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          seqused_k=seqused_k, page_table=page_table, rest=rest))
        if version == 4:
            assert cu_seqlens_q is not None and -1 not in window_size  # FA4: None = unbounded
            window = tuple(-1 if w is None else w for w in window_size)
        else:
            assert page_table is None and seqused_k is None, "only the stand-in of flash-attn 4 reads a page table"
            assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
            window = window_size
        cq = cu_seqlens_q.tolist()
        if page_table is not None:  # as flash-attn 4's asserts: no cu_seqlens_k, int32 table and lengths
            assert cu_seqlens_k is None and seqused_k is not None
            assert page_table.dtype == seqused_k.dtype == torch.int32 and page_table.shape[0] == len(cq) - 1
            keys = [(k[page_table[b]].flatten(0, 1)[:n], v[page_table[b]].flatten(0, 1)[:n])
                    for b, n in enumerate(seqused_k.tolist())]
        else:
            assert cu_seqlens_k is not None and seqused_k is None
            ck = cu_seqlens_k.tolist()
            keys = [(k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]) for b in range(len(cq) - 1)]
        out = torch.cat([oracle_attention(q[cq[b]:cq[b + 1]], kb, vb, softmax_scale, causal, window, softcap)
                         for b, (kb, vb) in enumerate(keys)]).to(q.dtype)
        return (out, None) if version == 4 else out  # FA4 returns (out, lse)

    return flash_attn_varlen_func


@pytest.fixture
def flash(monkeypatch):
    """``flash(version)`` installs a stand-in flash-attn ``version`` (4, 3 or 2); returns its call log.
    The backend then takes calls of any size (``MIN_QUERY_TOKENS`` 1: these batches are small)."""
    monkeypatch.setattr(flash_backend, "MIN_QUERY_TOKENS", 1)

    def install(version: int) -> list:
        calls = []
        package = types.ModuleType("flash_attn")
        interface = None
        if version == 4:
            cute = types.ModuleType("flash_attn.cute")
            cute.flash_attn_varlen_func = stand_in(4, calls)
            package.cute = cute
            monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
        elif version == 3:
            interface = types.ModuleType("flash_attn_interface")
            interface.flash_attn_varlen_func = stand_in(3, calls)
            monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
        else:
            package.flash_attn_varlen_func = stand_in(2, calls)
            monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
        monkeypatch.setitem(sys.modules, "flash_attn", package)
        monkeypatch.setitem(sys.modules, "flash_attn_interface", interface)
        flash_backend.find_library.cache_clear()
        return calls

    yield install
    flash_backend.find_library.cache_clear()


def batch(g, dtype=torch.bfloat16, head_size=64):
    lens_q, lens_k = [3, 1, 6], [5, 9, 6]
    cu_q = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 14, 20], dtype=torch.int32)
    q = randn_nonzero((sum(lens_q), 8, head_size), dtype, g)
    k, v = (randn_nonzero((sum(lens_k), 4, head_size), dtype, g) for _ in range(2))
    return q, k, v, cu_q, cu_k


def test_library_found_in_order_and_switched_off(flash, monkeypatch):
    flash(4)
    assert flash_backend.find_library().name == "flash-attn 4" and flash_backend.find_library().takes_page_table
    flash(3)
    assert flash_backend.find_library().name == "flash-attn 3" and not flash_backend.find_library().takes_page_table
    flash(2)
    assert flash_backend.find_library().name == "flash-attn 2" and not flash_backend.find_library().takes_page_table
    monkeypatch.setenv("COMPILED_ATTN_FLASH", "0")
    flash_backend.find_library.cache_clear()
    assert flash_backend.find_library() is None


def test_plan_takes_what_the_library_covers(flash, monkeypatch):
    g = torch.Generator().manual_seed(0)
    q = batch(g)[0]
    lam = torch.tensor(0.3)
    flash(4)
    fa4 = flash_backend.find_library()
    assert flash_backend.plan(fa4, q, None, None, None) == "plain"
    assert flash_backend.plan(fa4, q, lam, None, None) == "differential"  # measured faster than our fused kernel
    monkeypatch.setattr(flash_backend, "FLASH_DIFFERENTIAL", False)
    assert flash_backend.plan(fa4, q, lam, None, None) is None
    monkeypatch.setattr(flash_backend, "FLASH_DIFFERENTIAL", True)
    assert flash_backend.plan(fa4, batch(g, head_size=256)[0], lam, None, None) is None  # value head 512
    assert flash_backend.plan(fa4, q, None, torch.ones(8), None) is None  # ALiBi stays ours
    assert flash_backend.plan(fa4, q, None, None, torch.ones(2)) is None  # traced scalars stay ours
    assert flash_backend.plan(fa4, q.float(), None, None, None) is None
    assert flash_backend.plan(fa4, batch(g, head_size=72)[0][..., :70], None, None, None) is None
    flash(2)
    assert flash_backend.plan(flash_backend.find_library(), q, lam, None, None) is None  # no 2D value head
    assert not flash_backend.covers(q, *batch(g)[1:], None, 0.125, True, -1, -1, 0.0, None, None)  # CPU tensors


@pytest.mark.parametrize("version", [4, 3, 2])
@pytest.mark.parametrize("options", [(0.11, True, -1, -1, 0.0), (0.2, False, 3, 1, 5.0), (0.15, True, 2, -1, 0.0)])
def test_plain_prefill_through_flash_equals_oracle(flash, version, options):
    calls = flash(version)
    g = torch.Generator().manual_seed(1)
    q, k, v, cu_q, cu_k = batch(g)
    library = flash_backend.find_library()
    out = flash_backend.run(library, "plain", q, k, v, cu_q, cu_k, None, *options)
    scale, causal, left, right, softcap = options
    assert_close_to_oracle(out, oracle_varlen(q, k, v, cu_q, cu_k, scale, causal, (left, right), softcap))
    (call,) = calls
    assert call["scale"] == scale and call["causal"] == causal and call["softcap"] == softcap
    if version != 4:
        assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (6, 9) and call["window"] == (left, right)


@pytest.mark.parametrize("per_pair", [False, True])
def test_differential_prefill_is_two_flash_calls_and_equals_oracle(flash, per_pair):
    calls = flash(4)
    g = torch.Generator().manual_seed(2)
    q, k, v, cu_q, cu_k = batch(g)
    lam = randn_nonzero((4,) if per_pair else (), torch.float32, g) * 0.3
    out = flash_backend.run(flash_backend.find_library(), "differential", q, k, v, cu_q, cu_k, lam, 0.125, True,
                            -1, -1, 0.0)
    assert out.shape == (10, 4, 128) and out.dtype == q.dtype
    assert [c["shapes"] for c in calls] == [((10, 4, 64), (20, 2, 64), (20, 2, 128))] * 2
    # q1/q2, k1/k2 are strided views, [v1 | v2] a view of v: nothing copied on the way in
    size = q.element_size()
    assert [c["data_ptrs"] for c in calls] == [(q.data_ptr() + i * 64 * size, k.data_ptr() + i * 64 * size,
                                                v.data_ptr()) for i in (0, 1)]
    assert_close_to_oracle(out, oracle_varlen(q, k, v, cu_q, cu_k, 0.125, True, lambda_full=lam))


COMBINE_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_combine_kernel = pytest.mark.skipif(
    COMBINE_DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it unless the environment overrides it)")


def eager_combine(out1, out2, lam, dtype):
    """The eager expression the combine kernel replaces (``flash_backend.run`` before it)."""
    return (out1.float() - lam.float().reshape(1, -1, 1) * out2.float()).to(dtype)


@needs_combine_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lambda_shape", [(), (1,), "pairs"])
@pytest.mark.parametrize("shape", [(5, 3, 80), (3, 40, 256)])  # value width not a power of two; > one head block
def test_combine_kernel_is_the_eager_expression_and_the_float64_formula(dtype, lambda_shape, shape):
    pytest.importorskip("triton")
    from compiled_attn.ops.triton_kernels.combine_kernel import combine_pairs

    tokens, pairs, width = shape
    for seed, lambda_dtype in ((3, torch.float32), (4, torch.bfloat16)):
        g = torch.Generator().manual_seed(seed)
        # out1, out2 as token-strided slices of one [T, P, 2, V] buffer, as an out= buffer would give
        both = randn_nonzero((tokens, pairs, 2, width), dtype, g).to(COMBINE_DEVICE)
        out1, out2 = both[:, :, 0], both[:, :, 1]
        lam = randn_nonzero((pairs,) if lambda_shape == "pairs" else lambda_shape, lambda_dtype, g) * 0.7
        lam = lam.to(COMBINE_DEVICE)
        poisoned = torch.full((tokens, pairs, width), float("nan"), dtype=dtype, device=COMBINE_DEVICE)
        got = combine_pairs(out1, out2, lam, dtype, out=poisoned)
        assert got is poisoned and got.dtype == dtype
        assert torch.equal(got, eager_combine(out1, out2, lam, dtype)), "not bit-identical to the eager expression"
        assert torch.equal(combine_pairs(out1, out2, lam, dtype), got)  # its own contiguous output
        exact = out1.double() - lam.double().reshape(1, -1, 1) * out2.double()
        # float32 arithmetic, then one rounding to dtype (half an ulp, taken as a whole one,
        # and a subnormal's spacing near zero)
        info = torch.finfo(dtype)
        bound = (info.eps * exact.abs() + info.smallest_normal * info.eps
                 + 2.0 ** -22 * (out1.double().abs() + (lam.double().reshape(1, -1, 1) * out2.double()).abs()))
        assert bool(((got.double() - exact).abs() <= bound).all())


@needs_combine_kernel
def test_combine_takes_the_kernel_where_it_runs_and_the_eager_expression_elsewhere(monkeypatch):
    pytest.importorskip("triton")
    from compiled_attn.ops.triton_kernels import combine_kernel

    g = torch.Generator().manual_seed(5)
    out1, out2 = (randn_nonzero((6, 4, 96), torch.bfloat16, g).to(COMBINE_DEVICE) for _ in range(2))
    lam = (randn_nonzero((4,), torch.float32, g) * 0.5).to(COMBINE_DEVICE)
    launches = []
    real = combine_kernel.combine_pairs
    monkeypatch.setattr(combine_kernel, "combine_pairs", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    kernel = flash_backend.combine(out1, out2, lam, torch.bfloat16)
    assert launches == [1]
    if COMBINE_DEVICE == "cpu":
        monkeypatch.setattr(flash_backend, "_INTERPRETED", False)  # a CPU tensor without the interpreter
        eager = flash_backend.combine(out1, out2, lam, torch.bfloat16)
        assert launches == [1]
        assert torch.equal(kernel, eager)
    assert torch.equal(kernel, eager_combine(out1, out2, lam, torch.bfloat16))


class CudaLooking(torch.Tensor):
    """A CPU tensor that reports ``is_cuda``, so the backend's device check passes here."""

    @property
    def is_cuda(self):
        return True


def test_differential_calls_our_hopper_kernel_takes_stay_ours(flash, monkeypatch):
    """A differential call the varlen launcher routes to our Hopper prefill kernel (head size
    128 on an sm90 GPU: ``prefill_kernel_takes``, measured faster than flash-attn 4's two
    calls) is not the backend's; the same call at a head size that kernel does not take, or
    on another GPU, is (two calls); plain calls stay flash-attn's either way."""
    from compiled_attn.ops.triton_kernels import attention as launchers

    flash(4)
    g = torch.Generator().manual_seed(8)
    lam = torch.tensor(0.3)
    for head_size, sm90, ours in ((128, True, True), (128, False, False), (64, True, False)):
        monkeypatch.setattr(launchers, "is_hopper", lambda index, sm90=sm90: sm90)
        q, k, v, cu_q, cu_k = batch(g, head_size=head_size)
        q, k, v = (t.as_subclass(CudaLooking) for t in (q, k, v))
        args = (q, k, v, cu_q, cu_k, lam, 0.125, True, -1, -1, 0.0, None, None)
        assert flash_backend.covers(*args) is not ours, (head_size, sm90)
        assert flash_backend.covers(q, k, v, cu_q, cu_k, None, *args[6:])
    monkeypatch.setattr(launchers, "PREFILL_KERNEL", "unified")
    monkeypatch.setattr(launchers, "is_hopper", lambda index: True)
    q, k, v, cu_q, cu_k = (t.as_subclass(CudaLooking) if t.dim() == 3 else t for t in batch(g, head_size=128))
    assert flash_backend.covers(q, k, v, cu_q, cu_k, lam, 0.125, True, -1, -1, 0.0, None, None)


def test_plain_batches_of_many_short_causal_sequences_stay_on_the_gluon_kernel(flash, monkeypatch):
    """``gluon_faster``, shapes alone: a causal plain call at head size 128 of 8 sequences
    averaging 2 query tokens, which the Gluon kernel covers, runs on our kernel (with the
    call unchanged) though flash-attn 4 covers it; with fewer sequences, more tokens a
    sequence than ``GLUON_MAX_MEAN_QUERY`` (on the bound: kept), a window, non-causal, head
    size 64, a call the Gluon kernel does not cover, flash-attn 4 takes it; flash-attn 3
    (not measured against) keeps every call it covers; a differential call is not this
    rule's (here, on no sm90 GPU: flash-attn 4's two calls)."""
    from compiled_attn.ops import triton_kernels
    from compiled_attn.ops.triton_kernels import attention as launchers

    calls, ours, gluon, bound = flash(4), [], [], flash_backend.GLUON_MAX_MEAN_QUERY
    monkeypatch.setattr(launchers, "gluon_takes_varlen", lambda *args: gluon.append(args) or True)
    monkeypatch.setattr(triton_kernels, "varlen_attention", lambda *args: ours.append(args) or args[0])
    g = torch.Generator().manual_seed(9)

    def call(sequences=8, tokens=2, head_size=128, causal=True, window=(-1, -1), lam=None):
        q, k, v = (randn_nonzero((sequences * tokens, heads, head_size), torch.bfloat16, g).as_subclass(CudaLooking)
                   for heads in (8, 4, 4))
        cu = torch.arange(0, sequences + 1, dtype=torch.int32) * tokens
        return (q, k, v, cu, cu, lam, None, causal, *window, 0.0, None, None)

    args = call()
    assert not flash_backend.covers(*args)
    assert flash_backend.varlen_attention(*args) is args[0] and calls == []
    assert len(ours) == 1 and all(a is b for a, b in zip(ours[0], args))
    assert all(a is b for a, b in zip(gluon[-1], args[:5])) and gluon[-1][5:] == (None, None, True, -1, -1, 0.0)
    for given in (dict(sequences=7), dict(head_size=64), dict(causal=False), dict(window=(-1, 3)),
                  dict(window=(5, -1)), dict(lam=torch.tensor(0.3))):
        assert flash_backend.covers(*call(**given)), given
    monkeypatch.setattr(flash_backend, "GLUON_MAX_MEAN_QUERY", 2)  # the mean of call(): on the bound, kept
    assert not flash_backend.covers(*call())
    monkeypatch.setattr(flash_backend, "GLUON_MAX_MEAN_QUERY", 1)  # over it
    assert flash_backend.covers(*call())
    monkeypatch.setattr(flash_backend, "GLUON_MAX_MEAN_QUERY", bound)
    # the bound sits between measured rows (profiling/results/kernels.md, 2026-12-03): B=8 S=3072 ran
    # faster on ours, B=8 S=4096 on flash-attn 4
    for sequences, tokens, expected in ((8, 3072, True), (8, 4096, False)):
        q = torch.empty(1, 1, 1, dtype=torch.bfloat16).expand(sequences * tokens, 32, 128)
        assert flash_backend._gluon_shaped(q, sequences, True, -1, -1) is expected, (sequences, tokens)
    flash(3)  # measured against flash-attn 4 only: flash-attn 3 keeps the call
    assert flash_backend.covers(*call())
    calls = flash(4)
    monkeypatch.setattr(launchers, "gluon_takes_varlen", lambda *args: False)
    assert flash_backend.covers(*call())
    flash_backend.varlen_attention(*call())
    assert len(calls) == 1 and len(ours) == 1


def test_disabled_routes_covered_calls_to_our_kernel(flash, monkeypatch):
    calls = flash(4)
    ours = []

    def triton_varlen(q, k, v, cu_q, cu_k, lambda_full, scale, causal, left, right, softcap, *rest):
        ours.append(scale)
        return oracle_varlen(q, k, v, cu_q, cu_k, scale, causal, (left, right), softcap, lambda_full=lambda_full
                             ).to(q.dtype)

    from compiled_attn.ops import triton_kernels

    monkeypatch.setattr(triton_kernels, "varlen_attention", triton_varlen)
    g = torch.Generator().manual_seed(6)
    q, k, v, cu_q, cu_k = batch(g)
    q, k, v = (t.as_subclass(CudaLooking) for t in (q, k, v))
    args = (q, k, v, cu_q, cu_k, None, 0.125, True, -1, -1, 0.0, None, None)
    assert flash_backend.covers(*args)
    flash_backend.varlen_attention(*args)
    assert len(calls) == 1 and ours == []
    with flash_backend.disabled():
        assert not flash_backend.covers(*args)
        with flash_backend.disabled():  # nests
            out = flash_backend.varlen_attention(*args)
        assert not flash_backend.covers(*args)
        flash_backend.varlen_attention(*args)
    assert len(calls) == 1 and ours == [0.125, 0.125]
    assert_close_to_oracle(torch.Tensor(out), oracle_varlen(q, k, v, cu_q, cu_k, 0.125, True))
    assert flash_backend.covers(*args)  # back on after the block, also after an exception in it
    with pytest.raises(RuntimeError), flash_backend.disabled():
        raise RuntimeError
    assert flash_backend.covers(*args)


def test_calls_under_min_query_tokens_stay_on_our_kernel(flash, monkeypatch):
    """Shapes alone decide: 10 query tokens against a threshold of 10 and of 11."""
    calls = flash(4)
    g = torch.Generator().manual_seed(3)
    q, k, v, cu_q, cu_k = batch(g)
    q = q.as_subclass(CudaLooking)
    args = (q, k, v, cu_q, cu_k, None, None, True, -1, -1, 0.0, None, None)
    monkeypatch.setattr(flash_backend, "MIN_QUERY_TOKENS", q.shape[0])
    assert flash_backend.covers(*args)
    monkeypatch.setattr(flash_backend, "MIN_QUERY_TOKENS", q.shape[0] + 1)
    assert not flash_backend.covers(*args)
    assert flash_backend._formulation(q, k, v, torch.tensor(0.3), None, None) is None
    assert calls == []


def test_bench_ttft_rows_with_and_without_flash(flash, monkeypatch):
    from compiled_attn import benchmark

    model = torch.nn.Linear(2, 2, dtype=torch.bfloat16)
    model.config = types.SimpleNamespace(head_dim=64)
    q, k, v, cu_q, cu_k = batch(torch.Generator().manual_seed(7))
    q = q.as_subclass(CudaLooking)
    timed = []

    def timer(model_, prompt_len, kv_cache_dtype):
        """Records whether the backend would take a plain and a differential prefill now."""
        timed.append(tuple(flash_backend.covers(q, k, v, cu_q, cu_k, lam, None, True, -1, -1, 0.0, None, None)
                           for lam in (None, torch.tensor(0.3))))
        return {"first_s": 0.002 * len(timed), "later_s": 0.001 * len(timed), "warmup_s": 1.0}

    logged = []
    flash_on = {"first_s": 0.004, "later_s": 0.002, "warmup_s": 1.0}
    monkeypatch.setenv("COMPILED_ATTN_FLASH", "0")
    flash(4)
    assert benchmark.flash_ttft_rows(model, 512, "auto", flash_on, logged.append, timer) == []
    assert timed == [] and len(logged) == 1 and "no prefill/TTFT rows" in logged[0]

    monkeypatch.delenv("COMPILED_ATTN_FLASH")
    flash(4)
    logged.clear()
    assert benchmark.flash_ttft_rows(model, 512, "fp8", flash_on, logged.append, timer) == []
    assert timed == [] and len(logged) == 1 and "fp8" in logged[0]

    rows = benchmark.flash_ttft_rows(model, 512, "auto", flash_on, logged.append, timer)
    # the fresh engine runs with the backend off: neither plain nor differential covered
    assert timed == [(False, False)] and flash_backend._DISABLED == 0
    assert flash_backend.covers(q, k, v, cu_q, cu_k, None, None, True, -1, -1, 0.0, None, None)  # on again
    assert [(r.case, r.value, r.anchor_value) for r in rows] == [
        ("TTFT, prompt 512, first request: flash-attn 4 backend (differential two calls)", 4.0, 2.0),
        ("TTFT, prompt 512, later request: flash-attn 4 backend (differential two calls)", 2.0, 1.0)]


# --- paged prefill through flash-attn 4's page table -------------------------------------------

# a chunked prefill, a decode, a fresh prefill, a padded graph row, a prefix-cache hit: T = 32 > B = 6
MIXED = [(5, 7), (20, 1), (0, 18), pad(1), (33, 1), (9, 4)]


def paged_args(seqs=MIXED, block_size=16, dtype=torch.bfloat16, head_size=64, cuda=True, seed=8):
    """``(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table)``, NaN in every
    cache slot no sequence uses; query and caches CUDA-looking unless ``cuda=False``."""
    batch = make_paged_batch(seqs, block_size=block_size, num_heads=8, num_kv_heads=4, head_size=head_size,
                             dtype=dtype, seed=seed, unused_fill="nan")
    query, key_cache, value_cache, *metadata = batch.attention_args()
    if cuda:
        query, key_cache, value_cache = (t.as_subclass(CudaLooking) for t in (query, key_cache, value_cache))
    return (query, key_cache, value_cache, *metadata)


@pytest.fixture
def ours(monkeypatch):
    """Our Triton paged kernel replaced by a recorder: each call's schema arguments and the
    (zeros) tensor it returned."""
    from compiled_attn.ops import triton_kernels

    calls = []

    def triton_paged(*args):
        assert len(args) == 16  # the schema's arguments, in order
        calls.append(dict(args=args, out=args[0].new_zeros(args[0].shape)))
        return calls[-1]["out"]

    monkeypatch.setattr(triton_kernels, "paged_attention", triton_paged)
    return calls


def test_paged_chunks_of_at_most_the_mean_bound_stay_on_the_gluon_kernel(flash, ours, monkeypatch):
    """``gluon_faster_paged``, shapes alone: a causal plain paged prefill at head size 128
    that the Gluon kernel takes, of at most ``GLUON_MAX_MEAN_QUERY`` new tokens a sequence on
    average, runs on our kernel (the call unchanged) though flash-attn 4 covers it; over the
    bound, with a window, non-causal or one the Gluon kernel does not take, flash-attn 4
    does."""
    from compiled_attn.ops.triton_kernels import attention as launchers

    calls, gluon, bound = flash(4), [], flash_backend.GLUON_MAX_MEAN_QUERY
    monkeypatch.setattr(launchers, "gluon_takes_paged", lambda *args: gluon.append(args) or True)
    args = paged_args(head_size=128)
    full = (*args, None, None, True, -1, -1, 0.0, None, None)
    assert not flash_backend.covers_paged(*full)
    flash_backend.paged_attention(*args)
    assert calls == [] and len(ours) == 1
    assert all(a is b for a, b in zip(ours[0]["args"], args)) and ours[0]["args"][6:] == (None,) * 2 + (
        True, -1, -1, 0.0) + (None,) * 4
    assert all(a is b for a, b in zip(gluon[-1], args)) and gluon[-1][6:] == (None, None, True, -1, -1, 0.0)
    for given in (dict(causal=False), dict(window_right=3)):
        options = dict(dict(causal=True, window_left=-1, window_right=-1), **given)
        assert flash_backend.covers_paged(*args, None, None, options["causal"], options["window_left"],
                                          options["window_right"], 0.0, None, None), given
    # 3 sequences of 4 new tokens: a mean of 4 on the bound is kept, over it not (counted over
    # seq_lens' 3 sequences, not cu_seqlens_q's 4 entries)
    even = paged_args([(0, 4), (3, 4), (10, 4)], head_size=128)
    even_full = (*even, None, None, True, -1, -1, 0.0, None, None)
    monkeypatch.setattr(flash_backend, "GLUON_MAX_MEAN_QUERY", 4)
    assert not flash_backend.covers_paged(*even_full)
    monkeypatch.setattr(flash_backend, "GLUON_MAX_MEAN_QUERY", 3)
    assert flash_backend.covers_paged(*even_full)
    monkeypatch.setattr(flash_backend, "GLUON_MAX_MEAN_QUERY", bound)
    monkeypatch.setattr(launchers, "gluon_takes_paged", lambda *args: False)
    assert flash_backend.covers_paged(*full)


def test_paged_kernel_takes_the_schema_arguments_as_our_launcher_does():
    import inspect

    from compiled_attn.ops.triton_kernels.attention import paged_attention as launcher

    schema = [a.name for a in torch.ops.compiled_attn.paged_attention.default._schema.arguments]
    positional = [p.name for p in inspect.signature(launcher).parameters.values() if p.kind != p.KEYWORD_ONLY]
    assert positional == schema
    assert list(inspect.signature(flash_backend.paged_attention).parameters) == schema
    assert list(inspect.signature(flash_backend.covers_paged).parameters) == schema


@pytest.mark.parametrize("block_size", sorted(flash_backend.PAGED_BLOCK_SIZES))
@pytest.mark.parametrize("options", [(0.11, True, -1, -1, 0.0), (0.2, False, 3, 1, 5.0), (0.15, True, 2, -1, 0.0),
                                     (0.13, False, -1, 2, 0.0)])
def test_mixed_paged_prefill_runs_on_flash_attn_4_page_table_and_equals_oracle(flash, ours, block_size, options):
    calls = flash(4)
    query, key_cache, value_cache, cu_q, seq_lens, block_table = args = paged_args(block_size=block_size)
    assert query.shape[0] > seq_lens.shape[0]  # prefill-bearing
    full = (*args, None, *options, None, None, None, None)
    assert flash_backend.covers_paged(*full)
    out = flash_backend.paged_attention(*full)
    assert ours == [] and len(calls) == 1
    (call,) = calls
    scale, causal, left, right, softcap = options
    # our metadata as it is: no cu_seqlens_k, lengths and block table passed through, caches not copied
    assert call["page_table"] is block_table and call["seqused_k"] is seq_lens
    assert call["cu_seqlens_q"] is cu_q and call["cu_seqlens_k"] is None
    assert call["shapes"] == (tuple(query.shape), tuple(key_cache.shape), tuple(value_cache.shape))
    assert call["data_ptrs"] == (query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr())
    assert call["scale"] == scale and call["causal"] == causal and call["softcap"] == softcap
    assert call["window"] == (None if left < 0 else left, None if right < 0 else right)
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (None, None)  # no host read of the lengths
    assert out.shape == query.shape and out.dtype == query.dtype
    expected = oracle_paged(query, key_cache, value_cache, cu_q, seq_lens, block_table, scale, causal, (left, right),
                            softcap)
    assert_close_to_oracle(torch.Tensor(out), expected)
    assert bool(torch.isfinite(torch.Tensor(out)).all())  # nothing read from the NaN-poisoned slots


def test_paged_prefill_default_scale_is_the_head_size_rule(flash, ours):
    calls = flash(4)
    flash_backend.paged_attention(*paged_args(head_size=128))
    assert ours == [] and calls[0]["scale"] == 128 ** -0.5 and calls[0]["causal"] is True
    assert calls[0]["window"] == (None, None) and calls[0]["softcap"] == 0.0


def fp8(args):
    query, key_cache, value_cache, *metadata = args
    return (query, key_cache.to(torch.float8_e4m3fn), value_cache.to(torch.float8_e4m3fn), *metadata)


SCALE = torch.tensor(0.5)
OURS = {  # name: (schema arguments after block_table, or None for the defaults; the batch)
    "decode (T == B)": (None, lambda: paged_args([(5, 1), (20, 1), pad(1), (33, 1), (0, 1)])),
    "fewer queries than sequences": (None, lambda: paged_args([(5, 0), (20, 2), (33, 0)])),
    "differential": (dict(lambda_full=torch.tensor(0.3)), paged_args),
    "fp8 cache with scales": (dict(k_scale=SCALE, v_scale=SCALE), lambda: fp8(paged_args())),
    "fp8 cache without scales": (None, lambda: fp8(paged_args())),
    "alibi": (dict(alibi_slopes=torch.ones(8)), paged_args),
    "scale_softcap tensor": (dict(scale_softcap=torch.tensor([0.125, 0.0])), paged_args),
    "float32": (None, lambda: paged_args(dtype=torch.float32)),
    "head size 12": (None, lambda: paged_args(head_size=12)),
    "block size 64 (TMA pages)": (None, lambda: paged_args(block_size=64)),
    "block size 128 (TMA pages)": (None, lambda: paged_args(block_size=128)),
    "block size 8": (None, lambda: paged_args(block_size=8)),
    "CPU tensors": (None, lambda: paged_args(cuda=False)),
}


def schema_args(args, **given):
    names = [a.name for a in torch.ops.compiled_attn.paged_attention.default._schema.arguments][6:]
    defaults = dict(lambda_full=None, scale=0.125, causal=True, window_left=-1, window_right=-1, softcap=0.0,
                    alibi_slopes=None, scale_softcap=None, k_scale=None, v_scale=None)
    defaults.update(given)
    return (*args, *(defaults[n] for n in names))


@pytest.mark.parametrize("case", list(OURS))
def test_paged_calls_flash_does_not_cover_stay_on_our_kernel(flash, ours, case):
    calls = flash(4)
    given, make = OURS[case]
    full = schema_args(make(), **(given or {}))
    assert not flash_backend.covers_paged(*full)
    out = flash_backend.paged_attention(*full)
    assert calls == [] and len(ours) == 1 and out is ours[0]["out"]
    assert all(a is b for a, b in zip(ours[0]["args"], full))  # our kernel gets the call as it came


@pytest.mark.parametrize("version", [3, 2])
def test_paged_prefill_stays_on_our_kernel_with_libraries_without_a_page_table(flash, ours, version):
    calls = flash(version)
    full = schema_args(paged_args())
    assert not flash_backend.covers_paged(*full)
    flash_backend.paged_attention(*full)
    assert calls == [] and len(ours) == 1


def test_disabled_routes_paged_prefill_to_our_kernel(flash, ours, monkeypatch):
    calls = flash(4)
    full = schema_args(paged_args())
    assert flash_backend.covers_paged(*full)
    with flash_backend.disabled():
        assert not flash_backend.covers_paged(*full)
        flash_backend.paged_attention(*full)
    assert calls == [] and len(ours) == 1
    flash_backend.paged_attention(*full)
    assert len(calls) == 1 and len(ours) == 1
    monkeypatch.setenv("COMPILED_ATTN_FLASH", "0")
    flash_backend.find_library.cache_clear()
    assert not flash_backend.covers_paged(*full)
    flash_backend.paged_attention(*full)
    assert len(calls) == 1 and len(ours) == 2
