"""The flash-attn backend of ``varlen_attention`` with stand-in ``flash_attn`` modules.

No flash-attn builds here, so stand-in modules (``flash_attn.cute`` for flash-attn 4,
``flash_attn`` for flash-attn 2) record each call and compute it with the float64 oracle of
``tests/oracle.py``, honouring only the arguments flash-attn documents (so a wrong mapping of
scale, causal, window or softcap gives a wrong result). Checked: which library is found,
which calls the backend takes (plain; differential as two calls with a ``2 * D`` value head
on flash-attn 4 only; never ALiBi or traced scalars), the arguments passed, and results equal
to the oracle's for plain and differential attention.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from oracle import assert_close_to_oracle, oracle_attention, oracle_varlen
from paged_batches import randn_nonzero

from compiled_attn.ops import flash_backend


def stand_in(version: int, calls: list):
    """A flash_attn_varlen_func that computes with the oracle (float64) and records its kwargs."""

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, **rest):
        calls.append(dict(shapes=(tuple(q.shape), tuple(k.shape), tuple(v.shape)), max_seqlen_q=max_seqlen_q,
                          max_seqlen_k=max_seqlen_k, scale=softmax_scale, causal=causal, window=window_size,
                          softcap=softcap, rest=rest))
        if version == 4:
            assert None not in (cu_seqlens_q, cu_seqlens_k) and -1 not in window_size  # FA4: None = unbounded
            window = tuple(-1 if w is None else w for w in window_size)
        else:
            assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
            window = window_size
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        out = torch.cat([oracle_attention(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], softmax_scale,
                                          causal, window, softcap) for b in range(len(cq) - 1)]).to(q.dtype)
        return (out, None) if version == 4 else out  # FA4 returns (out, lse)

    return flash_attn_varlen_func


@pytest.fixture
def flash(monkeypatch):
    """``flash(version)`` installs a stand-in flash-attn ``version`` (4 or 2); returns its call log."""

    def install(version: int) -> list:
        calls = []
        package = types.ModuleType("flash_attn")
        if version == 4:
            cute = types.ModuleType("flash_attn.cute")
            cute.flash_attn_varlen_func = stand_in(4, calls)
            package.cute = cute
            monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
        else:
            package.flash_attn_varlen_func = stand_in(2, calls)
            monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
        monkeypatch.setitem(sys.modules, "flash_attn", package)
        monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
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
    assert flash_backend.find_library().name == "flash-attn 4"
    flash(2)
    assert flash_backend.find_library().name == "flash-attn 2"
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
    assert flash_backend.plan(fa4, q, lam, None, None) is None  # measured slower than our fused kernel
    monkeypatch.setattr(flash_backend, "FLASH_DIFFERENTIAL", True)
    assert flash_backend.plan(fa4, q, lam, None, None) == "differential"
    assert flash_backend.plan(fa4, batch(g, head_size=256)[0], lam, None, None) is None  # value head 512
    assert flash_backend.plan(fa4, q, None, torch.ones(8), None) is None  # ALiBi stays ours
    assert flash_backend.plan(fa4, q, None, None, torch.ones(2)) is None  # traced scalars stay ours
    assert flash_backend.plan(fa4, q.float(), None, None, None) is None
    assert flash_backend.plan(fa4, batch(g, head_size=72)[0][..., :70], None, None, None) is None
    flash(2)
    assert flash_backend.plan(flash_backend.find_library(), q, lam, None, None) is None  # no 2D value head
    assert not flash_backend.covers(q, *batch(g)[1:], None, 0.125, True, -1, -1, 0.0, None, None)  # CPU tensors


@pytest.mark.parametrize("version", [4, 2])
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
    if version == 2:
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
    assert_close_to_oracle(out, oracle_varlen(q, k, v, cu_q, cu_k, 0.125, True, lambda_full=lam))
