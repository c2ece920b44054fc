"""``compiled_attn.flash_attn_interface`` against flash-attn 2.x's documented semantics.

Every output is compared with the float64 oracle of ``tests/oracle.py`` (written from the
flash-attn conventions, independent of our ops), sequence by sequence; ``softmax_lse`` with
a float64 log-sum-exp over the oracle's own visibility mask. Inputs are fresh random values,
caches hold random garbage outside the keys a call may read, and GQA, ``seqlen_q !=
seqlen_k``, windows, softcap and ALiBi are covered. Runs on the CPU (our ops' reference
kernels) and, with ``pytest -m gpu``, on CUDA.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oracle import assert_close_to_oracle, oracle_attention, visibility_mask
from paged_batches import randn_nonzero

from compiled_attn.flash_attn_interface import (
    FlashAttnArgumentError,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
H, HKV, D = 4, 2, 32
OPTIONS = {  # (causal, window_size, softcap, alibi)
    "plain": (False, (-1, -1), 0.0, False),
    "causal": (True, (-1, -1), 0.0, False),
    "window": (False, (3, 1), 0.0, False),
    "causal-window-softcap-alibi": (True, (4, -1), 2.0, True),
}


def rand(shape, g, device):
    return randn_nonzero(shape, torch.float32, g).to(device)


def slopes(device):
    return torch.tensor([2.0 ** (-(i + 1)) for i in range(H)], device=device)


def oracle_lse(q, k, scale, causal, window, softcap, alibi) -> torch.Tensor:
    """float64 ``[H, q_len]`` log-sum-exp of one sequence; ``+inf`` for a row seeing no key."""
    q, k = q.double().cpu(), k.double().cpu()
    q_len, k_len = q.shape[0], k.shape[0]
    mask = torch.tensor(visibility_mask(q_len, k_len, causal, window), dtype=torch.bool).view(q_len, k_len)
    out = torch.empty(q.shape[1], q_len, dtype=torch.float64)
    for h in range(q.shape[1]):
        s = q[:, h] @ k[:, h // (q.shape[1] // k.shape[1])].T * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if alibi is not None:
            pos = torch.arange(q_len)[:, None] + k_len - q_len
            s = s - float(alibi[h]) * (pos - torch.arange(k_len)).abs()
        lse = torch.logsumexp(s.masked_fill(~mask, -math.inf), dim=-1)
        out[h] = torch.where(torch.isneginf(lse), math.inf, lse)
    return out


def expected(q, k, v, causal, window, softcap, alibi):
    return oracle_attention(q, k, v, D ** -0.5, causal, window, softcap, alibi)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(OPTIONS))
def test_flash_attn_func_matches_oracle_with_lse(case, device):
    causal, window, softcap, alibi = OPTIONS[case]
    g = torch.Generator().manual_seed(1)
    q, k, v = rand((2, 5, H, D), g, device), rand((2, 9, HKV, D), g, device), rand((2, 9, HKV, D), g, device)
    alibi_slopes = slopes(device) if alibi else None
    out, lse, dmask = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                      alibi_slopes=alibi_slopes, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, H, 5) and dmask is None
    for b in range(2):
        assert_close_to_oracle(out[b], expected(q[b], k[b], v[b], causal, window, softcap, alibi_slopes))
        torch.testing.assert_close(lse[b].double().cpu(), oracle_lse(q[b], k[b], D ** -0.5, causal, window,
                                                                     softcap, alibi_slopes), atol=1e-4, rtol=1e-5)
    assert torch.equal(flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                       alibi_slopes=alibi_slopes), out)


def test_packed_variants_equal_the_unpacked_call():
    g = torch.Generator().manual_seed(2)
    qkv = rand((2, 6, 3, H, D), g, "cpu")
    q, k, v = qkv.unbind(2)
    assert torch.equal(flash_attn_qkvpacked_func(qkv, causal=True), flash_attn_func(q, k, v, causal=True))
    kv = rand((2, 8, 2, HKV, D), g, "cpu")
    assert torch.equal(flash_attn_kvpacked_func(q, kv), flash_attn_func(q, *kv.unbind(2)))


def test_flash_attn_func_gradients_match_float64():
    g = torch.Generator().manual_seed(3)
    q, k, v = (rand(shape, g, "cpu").double().float().requires_grad_() for shape in
               ((2, 4, H, D), (2, 7, HKV, D), (2, 7, HKV, D)))
    weight = rand((2, 4, H, D), g, "cpu")
    grads = torch.autograd.grad((flash_attn_func(q, k, v, causal=True) * weight).sum(), (q, k, v))

    def dense(q, k, v):  # float64 causal attention, bottom-right aligned, GQA by repetition
        k, v = (t.repeat_interleave(H // HKV, dim=2) for t in (k, v))
        s = torch.einsum("bihd,bjhd->bhij", q, k) * D ** -0.5
        mask = torch.ones(4, 7, dtype=torch.bool).tril(7 - 4)
        p = s.masked_fill(~mask, -math.inf).softmax(-1)
        return torch.einsum("bhij,bjhd->bihd", p, v)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    exact = torch.autograd.grad((dense(q64, k64, v64) * weight.double()).sum(), (q64, k64, v64))
    for got, want in zip(grads, exact):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def varlen_batch(g, device, q_lens=(1, 7, 3), k_lens=(4, 7, 10)):
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = rand((sum(q_lens), H, D), g, device)
    k, v = rand((sum(k_lens), HKV, D), g, device), rand((sum(k_lens), HKV, D), g, device)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(OPTIONS))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_flash_attn_varlen_func_matches_oracle(case, paged, device):
    causal, window, softcap, alibi = OPTIONS[case]
    g = torch.Generator().manual_seed(4)
    q, k, v, cu_q, cu_k = varlen_batch(g, device)
    alibi_slopes = slopes(device) if alibi else None
    kwargs = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi_slopes,
                  return_attn_probs=True)
    if paged:  # the keys of each sequence in shuffled 4-token blocks of a cache holding garbage elsewhere
        page, width = 4, 3
        perm = torch.randperm(12, generator=g)
        table = perm[:9].view(3, width).to(torch.int32).to(device)
        k_cache, v_cache = rand((12, page, HKV, D), g, device), rand((12, page, HKV, D), g, device)
        for b in range(3):
            keys = range(int(cu_k[b]), int(cu_k[b + 1]))
            for j, t in enumerate(keys):
                k_cache[table[b, j // page], j % page] = k[t]
                v_cache[table[b, j // page], j % page] = v[t]
        out, lse, _ = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, 7, 10, block_table=table, **kwargs)
    else:
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 10, **kwargs)
    assert out.shape == q.shape and lse.shape == (H, q.shape[0])
    for b in range(3):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        assert_close_to_oracle(out[qs], expected(q[qs], k[ks], v[ks], causal, window, softcap, alibi_slopes))
        torch.testing.assert_close(lse[:, qs].double().cpu(), oracle_lse(q[qs], k[ks], D ** -0.5, causal, window,
                                                                         softcap, alibi_slopes), atol=1e-4, rtol=1e-5)


def kvcache_case(g, device, *, paged, batch_idx, leftpad, new):
    """q, caches (garbage outside the keys), and per sequence the keys the call must see."""
    batch, seqlen_q, rows, seqlen_cache = 3, 2, 4, 16
    q = rand((batch, seqlen_q, H, D), g, device)
    cache_seqlens = torch.tensor([5, 0, 11], dtype=torch.int32, device=device)
    k_new = rand((batch, new, HKV, D), g, device) if new else None
    v_new = rand((batch, new, HKV, D), g, device) if new else None
    pad = torch.tensor([2, 0, 3], dtype=torch.int32, device=device) if leftpad else None
    idx = torch.tensor([2, 0, 3], dtype=torch.int32, device=device) if batch_idx else None
    if paged:
        page, width = 4, 5
        k_cache, v_cache = rand((16, page, HKV, D), g, device), rand((16, page, HKV, D), g, device)
        table = torch.randperm(16, generator=g)[:15].view(batch, width).to(torch.int32).to(device)
        dense_k = k_cache[table.long()].flatten(1, 2)  # [B, width * page, ...] views by position
        dense_v = v_cache[table.long()].flatten(1, 2)
    else:
        table = None
        k_cache, v_cache = rand((rows, seqlen_cache, HKV, D), g, device), rand((rows, seqlen_cache, HKV, D), g, device)
        rows_of = idx.long() if batch_idx else torch.arange(batch, device=device)
        dense_k, dense_v = k_cache[rows_of], v_cache[rows_of]
    seen = []
    for b in range(batch):
        end = int(cache_seqlens[b])
        keys, values = dense_k[b, :end], dense_v[b, :end]
        if new:
            keys, values = torch.cat([keys, k_new[b]]), torch.cat([values, v_new[b]])
        start = int(pad[b]) if leftpad else 0
        seen.append((keys[start:], values[start:]))
    call = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, cache_seqlens=cache_seqlens,
                cache_batch_idx=idx, cache_leftpad=pad, block_table=table)
    return call, seen


KVCACHE_LAYOUTS = {
    "dense": dict(paged=False, batch_idx=False, leftpad=False),
    "batch_idx": dict(paged=False, batch_idx=True, leftpad=False),
    "leftpad": dict(paged=False, batch_idx=True, leftpad=True),
    "paged": dict(paged=True, batch_idx=False, leftpad=False),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("new", [0, 3], ids=["no-new", "append-3"])
@pytest.mark.parametrize("layout", list(KVCACHE_LAYOUTS))
@pytest.mark.parametrize("case", ["causal", "causal-window-softcap-alibi", "plain"])
def test_flash_attn_with_kvcache_matches_oracle_and_appends(case, layout, new, device):
    causal, window, softcap, alibi = OPTIONS[case]
    g = torch.Generator().manual_seed(5)
    call, seen = kvcache_case(g, device, new=new, **KVCACHE_LAYOUTS[layout])
    before_k = call["k_cache"].clone()
    alibi_slopes = slopes(device) if alibi else None
    out, lse = flash_attn_with_kvcache(**call, causal=causal, window_size=window, softcap=softcap,
                                       alibi_slopes=alibi_slopes, return_softmax_lse=True)
    assert out.shape == call["q"].shape and lse.shape == (3, H, 2)
    for b, (keys, values) in enumerate(seen):
        assert_close_to_oracle(out[b], expected(call["q"][b], keys, values, causal, window, softcap, alibi_slopes))
        torch.testing.assert_close(lse[b].double().cpu(), oracle_lse(call["q"][b], keys, D ** -0.5, causal, window,
                                                                     softcap, alibi_slopes), atol=1e-4, rtol=1e-5)
    written = (call["k_cache"] != before_k).any(-1).any(-1)  # [blocks or rows, positions] changed
    assert int(written.sum()) == 3 * new  # exactly the new keys, nowhere else


def test_kvcache_append_lands_at_cache_seqlens():
    """The appended keys are in the cache afterwards, where the next call reads them."""
    g = torch.Generator().manual_seed(6)
    k_cache, v_cache = rand((2, 8, HKV, D), g, "cpu"), rand((2, 8, HKV, D), g, "cpu")
    k, v = rand((2, 1, HKV, D), g, "cpu"), rand((2, 1, HKV, D), g, "cpu")
    q = rand((2, 1, H, D), g, "cpu")
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([3, 6], dtype=torch.int32))
    assert torch.equal(k_cache[0, 3], k[0, 0]) and torch.equal(k_cache[1, 6], k[1, 0])
    assert torch.equal(v_cache[0, 3], v[0, 0]) and torch.equal(v_cache[1, 6], v[1, 0])


def test_errors_are_flash_attns():
    g = torch.Generator().manual_seed(7)
    q, k, v, cu_q, cu_k = varlen_batch(g, "cpu")
    with pytest.raises(NotImplementedError, match="dropout_p"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 10, dropout_p=0.1)
    with pytest.raises(RuntimeError, match="cu_seqlens_q"):
        flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, 7, 10)
    with pytest.raises(RuntimeError, match="must divide"):
        flash_attn_varlen_func(q[:, :3], k, v, cu_q, cu_k, 7, 10)
    with pytest.raises(RuntimeError, match="same dtype"):
        flash_attn_varlen_func(q.half(), k, v, cu_q, cu_k, 7, 10)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 10, alibi_slopes=torch.ones(3, H))
    call, _ = kvcache_case(g, "cpu", paged=True, batch_idx=False, leftpad=False, new=0)
    with pytest.raises(RuntimeError, match="block table"):  # 11 + 10 keys > 5 blocks of 4
        flash_attn_with_kvcache(**{**call, "cache_seqlens": call["cache_seqlens"] + 10})
    with pytest.raises(RuntimeError, match="cache_batch_idx"):
        flash_attn_with_kvcache(**{**call, "cache_batch_idx": torch.zeros(3, dtype=torch.int32)})
    with pytest.raises(NotImplementedError, match="rotary"):
        flash_attn_with_kvcache(**call, rotary_cos=torch.ones(8, D // 2), rotary_sin=torch.ones(8, D // 2))
    # our ops' own checks surface with flash-attn's exception type too
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(**{**call, "block_table": call["block_table"] + 100})
    assert issubclass(FlashAttnArgumentError, ValueError) and issubclass(FlashAttnArgumentError, TypeError)


def test_compiled_decode_loop_has_no_graph_break_and_matches_eager():
    """A decode loop written against the API compiles with ``fullgraph=True``, once."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(8)
    caches = [rand((8, 4, HKV, D), g, "cpu") for _ in range(2)]
    table = torch.randperm(8, generator=g)[:6].view(2, 3).to(torch.int32)
    steps = [(rand((2, 1, H, D), g, "cpu"), rand((2, 1, HKV, D), g, "cpu"), rand((2, 1, HKV, D), g, "cpu"))
             for _ in range(4)]

    def step(q, k, v, k_cache, v_cache, cache_seqlens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=table,
                                       causal=True)

    def run(fn):
        k_cache, v_cache = (c.clone() for c in caches)
        outs = []
        for i, (q, k, v) in enumerate(steps):
            outs.append(fn(q, k, v, k_cache, v_cache, torch.tensor([5 + i, 2 + i], dtype=torch.int32)))
        return outs, k_cache

    eager, eager_cache = run(step)
    torch._dynamo.reset()
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    compiled, compiled_cache = run(torch.compile(step, fullgraph=True))
    assert sum(counters["graph_break"].values()) == breaks
    assert counters["stats"]["unique_graphs"] - graphs == 1
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.equal(compiled_cache, eager_cache)


def test_varlen_buffers_longer_than_the_tokens_are_allowed():
    """flash-attn accepts rows past ``cu_seqlens[-1]`` (padding to a static shape); the
    used rows equal the unpadded call, the spare ones are zeros (lse ``+inf``)."""
    g = torch.Generator().manual_seed(9)
    q, k, v, cu_q, cu_k = varlen_batch(g, "cpu")
    pad_q, pad_k = rand((3, H, D), g, "cpu"), rand((5, HKV, D), g, "cpu")
    want, want_lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 10, causal=True, return_attn_probs=True)
    got, lse, _ = flash_attn_varlen_func(torch.cat((q, pad_q)), torch.cat((k, pad_k)), torch.cat((v, pad_k)),
                                         cu_q, cu_k, 7, 10, causal=True, return_attn_probs=True)
    assert torch.equal(got[:q.shape[0]], want) and not got[q.shape[0]:].any()
    assert torch.equal(lse[:, :q.shape[0]], want_lse) and torch.isinf(lse[:, q.shape[0]:]).all()


def test_paged_kvcache_without_cache_seqlens_reads_the_whole_table():
    g = torch.Generator().manual_seed(10)
    call, _ = kvcache_case(g, "cpu", paged=True, batch_idx=False, leftpad=False, new=0)
    full = torch.full((3,), call["block_table"].shape[1] * call["k_cache"].shape[1], dtype=torch.int32)
    assert torch.equal(flash_attn_with_kvcache(**{**call, "cache_seqlens": None}),
                       flash_attn_with_kvcache(**{**call, "cache_seqlens": full}))


def test_kvcache_argument_errors_use_flash_attns_names():
    g = torch.Generator().manual_seed(11)
    call, _ = kvcache_case(g, "cpu", paged=False, batch_idx=True, leftpad=True, new=0)
    with pytest.raises(RuntimeError, match="cache_leftpad must lie in"):
        flash_attn_with_kvcache(**{**call, "cache_leftpad": torch.tensor([9, 0, 0], dtype=torch.int32)})
    with pytest.raises(RuntimeError, match=r"cache_batch_idx must hold rows of k_cache in \[0, 4\)"):
        flash_attn_with_kvcache(**{**call, "cache_batch_idx": torch.tensor([5, 0, 1], dtype=torch.int32)})


def test_empty_queries_give_an_empty_output():
    g = torch.Generator().manual_seed(12)
    q, k = rand((2, 0, H, D), g, "cpu"), rand((2, 5, HKV, D), g, "cpu")
    assert flash_attn_func(q, k, k).shape == (2, 0, H, D)


def test_compiled_calls_at_flash_attn_defaults_give_our_op_floats():
    """At flash-attn's defaults (no ``softmax_scale``, ``softcap=0.0``) the varlen op gets
    the scale and softcap as floats, which the flash-attn backend can take; given values go
    as the ``scale_softcap`` tensor (no recompile when they change)."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (randn_nonzero((10, heads, 16), torch.float32, g) for heads in (4, 2, 2))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(node.args[12] is None for node in gm.graph.nodes
                    if node.target is torch.ops.compiled_attn.varlen_attention.default)
        return gm

    for kwargs, floats in ((dict(), True), (dict(softcap=0.0), True), (dict(softmax_scale=0.3), False),
                           (dict(softcap=2.0), False)):
        seen.clear()
        torch.compile(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True, **kwargs),
                      backend=backend, fullgraph=True)(q, k, v)
        assert seen == [floats], kwargs


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor value on the host (``int(t)``, ``bool(t)``, ``t.item()``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def interface_calls():
    """(name, make, whether the interface checks values on the host); ``make()`` builds fresh
    inputs and returns the call, which returns the tensors to compare."""
    def func():
        g = torch.Generator().manual_seed(13)
        q, k = rand((2, 5, H, D), g, "cpu"), rand((2, 9, HKV, D), g, "cpu")
        return lambda: flash_attn_func(q, k, k, causal=True, return_attn_probs=True)[:2]

    def varlen():
        q, k, v, cu_q, cu_k = varlen_batch(torch.Generator().manual_seed(15), "cpu")
        return lambda: [flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 10, causal=True)]

    def varlen_paged():
        q, k, v, cu_q, cu_k = varlen_batch(torch.Generator().manual_seed(15), "cpu")
        table = (cu_k[:-1, None] + torch.arange(10)).clamp(max=20).to(torch.int32)  # blocks of one key
        return lambda: [flash_attn_varlen_func(q, k[:, None], v[:, None], cu_q, cu_k, 7, 10, causal=True,
                                               block_table=table)]

    def kvcache(layout):
        def make():
            call, _ = kvcache_case(torch.Generator().manual_seed(16), "cpu", new=3, **KVCACHE_LAYOUTS[layout])
            return lambda: [*flash_attn_with_kvcache(**call, causal=True, return_softmax_lse=True), call["k_cache"],
                            call["v_cache"]]
        return make

    return ([("flash_attn_func", func, False), ("varlen", varlen, True), ("varlen-paged", varlen_paged, True)]
            + [(f"kvcache-{layout}", kvcache(layout), True) for layout in KVCACHE_LAYOUTS])


@pytest.mark.parametrize("name, make, checks", interface_calls(), ids=[c[0] for c in interface_calls()])
def test_value_checks_off_read_no_device_value(name, make, checks, monkeypatch):
    """``COMPILED_ATTN_CHECK_VALUES=0`` (as a CUDA-graph capture or compiling) turns off every
    host read of a tensor value the interface makes, and the result stays the same."""
    monkeypatch.setenv("COMPILED_ATTN_CHECK_VALUES", "1")
    call = make()
    with HostReads() as on:
        want = call()
    assert (on.count > 0) == checks  # the counter sees the interface's checks
    monkeypatch.setenv("COMPILED_ATTN_CHECK_VALUES", "0")
    call = make()
    with HostReads() as off:
        got = call()
    assert off.count == 0
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_kvcache_has_no_autograd_as_flash_attn():
    """Appending grad-requiring k/v leaves the cache a leaf without grad; outputs carry no graph."""
    g = torch.Generator().manual_seed(17)
    k_cache, v_cache = rand((2, 8, HKV, D), g, "cpu"), rand((2, 8, HKV, D), g, "cpu")
    q = rand((2, 1, H, D), g, "cpu").requires_grad_()
    appended = []
    for step in range(3):
        k, v = (rand((2, 1, HKV, D), g, "cpu").requires_grad_() for _ in range(2))
        appended.append((k.detach(), v.detach()))
        out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, return_softmax_lse=True,
                                           cache_seqlens=torch.tensor([step, 4 + step], dtype=torch.int32))
        assert not out.requires_grad and out.grad_fn is None and not lse.requires_grad
    for cache in (k_cache, v_cache):
        assert cache.is_leaf and not cache.requires_grad and cache.grad_fn is None
    for i, cache in enumerate((k_cache, v_cache)):
        new = torch.cat([kv[i] for kv in appended], dim=1)  # [2, 3, HKV, D]
        assert torch.equal(cache[0, 0:3], new[0]) and torch.equal(cache[1, 4:7], new[1])
    for b, end in enumerate((3, 7)):  # the last call saw the keys appended so far
        assert_close_to_oracle(out[b], expected(q[b].detach(), k_cache[b, :end], v_cache[b, :end], False,
                                                (-1, -1), 0.0, None))


def test_compiled_kvcache_call_with_a_grad_requiring_query_equals_eager():
    g = torch.Generator().manual_seed(18)
    k_cache, v_cache = rand((2, 8, HKV, D), g, "cpu"), rand((2, 8, HKV, D), g, "cpu")
    cache_seqlens = torch.tensor([3, 6], dtype=torch.int32)
    q = rand((2, 2, H, D), g, "cpu").requires_grad_()
    torch._dynamo.reset()
    got = torch.compile(lambda q: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                                          causal=True), fullgraph=True)(q)
    want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=True)
    assert not got.requires_grad
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for b, end in enumerate((3, 6)):
        assert_close_to_oracle(want[b], expected(q[b].detach(), k_cache[b, :end], v_cache[b, :end], True,
                                                 (-1, -1), 0.0, None))


def last_dim_strided(t):
    """``t``'s values with ``stride(-1) != 1``."""
    out = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert out.stride(-1) != 1 and torch.equal(out, t)
    return out


def test_inputs_flash_attn_accepts():
    """q/k/v strided in the last dim are made contiguous; NumPy numbers are numbers."""
    g = torch.Generator().manual_seed(19)
    q, k, v = rand((2, 5, H, D), g, "cpu"), rand((2, 9, HKV, D), g, "cpu"), rand((2, 9, HKV, D), g, "cpu")
    want = flash_attn_func(q, k, v, softmax_scale=0.125, window_size=(3, 1), softcap=2.0)
    assert torch.equal(flash_attn_func(*map(last_dim_strided, (q, k, v)), softmax_scale=np.float32(0.125),
                                       window_size=(np.int64(3), np.int32(1)), softcap=np.float64(2.0)), want)
    qv, kv, vv, cu_q, cu_k = varlen_batch(g, "cpu")
    assert torch.equal(flash_attn_varlen_func(*map(last_dim_strided, (qv, kv, vv)), cu_q, cu_k, 7, 10, causal=True),
                       flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 7, 10, causal=True))
    results = []
    for convert, seqlens in ((lambda t: t, 3), (last_dim_strided, np.int64(3))):
        cache_g = torch.Generator().manual_seed(20)
        k_cache, v_cache = rand((2, 8, HKV, D), cache_g, "cpu"), rand((2, 8, HKV, D), cache_g, "cpu")
        out = flash_attn_with_kvcache(convert(q[:, :2]), k_cache, v_cache, convert(k[:, :2]), convert(v[:, :2]),
                                      cache_seqlens=seqlens, causal=True)
        results.append((out, k_cache, v_cache))
    (out, k_cache, v_cache), strided = results
    assert all(torch.equal(a, b) for a, b in zip(strided, (out, k_cache, v_cache)))
    assert torch.equal(k_cache[:, 3:5], k[:, :2]) and torch.equal(v_cache[:, 3:5], v[:, :2])
    for b in range(2):
        assert_close_to_oracle(out[b], expected(q[b, :2], k_cache[b, :5], v_cache[b, :5], True, (-1, -1), 0.0, None))


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


KVCACHE_ERRORS = {  # changes to a valid call (leftpad layout, 3 new keys): exception, message
    "seqlens-float": (lambda c: dict(cache_seqlens=2.0), FlashAttnArgumentError,
                      r"cache_seqlens must be an int or an int32 tensor of shape \(batch_size,\) = \(3,\), got float"),
    "seqlens-list": (lambda c: dict(cache_seqlens=[1, 2, 3]), FlashAttnArgumentError, "got list"),
    "seqlens-negative": (lambda c: dict(cache_seqlens=i32(5, -1, 11)), FlashAttnArgumentError,
                         r"cache_seqlens must be >= 0 .* got cache_seqlens \[5, -1, 11\]"),
    "seqlens-device": (lambda c: dict(cache_seqlens=torch.zeros(3, dtype=torch.int32, device="meta")),
                       FlashAttnArgumentError, "cache_seqlens must be on q's device cpu, got cache_seqlens on meta"),
    "leftpad-device": (lambda c: dict(cache_leftpad=torch.zeros(3, dtype=torch.int32, device="meta")),
                       FlashAttnArgumentError, "cache_leftpad must be on q's device cpu, got cache_leftpad on meta"),
    "batch-idx-device": (lambda c: dict(cache_batch_idx=torch.zeros(3, dtype=torch.int32, device="meta")),
                         FlashAttnArgumentError, "cache_batch_idx must be on q's device cpu"),
    "leftpad-one": (lambda c: dict(cache_leftpad=i32(0)), FlashAttnArgumentError,
                    r"cache_leftpad must be an int32 tensor of shape \(batch_size,\) = \(3,\), got a tensor of "
                    r"shape \(1,\)"),
    "leftpad-float": (lambda c: dict(cache_leftpad=torch.zeros(3)), FlashAttnArgumentError,
                      "cache_leftpad must be an int32 .* torch.float32"),
    "leftpad-int64": (lambda c: dict(cache_leftpad=torch.zeros(3, dtype=torch.int64)), FlashAttnArgumentError,
                      "cache_leftpad must be an int32 .* torch.int64"),
    "leftpad-2d": (lambda c: dict(cache_leftpad=torch.zeros(3, 1, dtype=torch.int32)), FlashAttnArgumentError,
                   r"cache_leftpad must be .* got a tensor of shape \(3, 1\)"),
    "leftpad-strided-cache": (lambda c: dict(k_cache=torch.zeros(4, 20, HKV, D)[:, :16],
                                             v_cache=torch.zeros(4, 20, HKV, D)[:, :16]),
                              NotImplementedError, "cache_leftpad with k_cache/v_cache not contiguous"),
    "batch-idx-length": (lambda c: dict(cache_batch_idx=i32(0, 1)), FlashAttnArgumentError,
                         r"cache_batch_idx must be an int32 tensor of shape \(batch_size,\) = \(3,\)"),
    "batch-idx-int64": (lambda c: dict(cache_batch_idx=torch.tensor([2, 0, 3])), FlashAttnArgumentError,
                        "cache_batch_idx must be an int32 .* torch.int64"),
    "batch-over-cache-rows": (lambda c: dict(cache_batch_idx=None, cache_leftpad=None, k_cache=c["k_cache"][:2],
                                             v_cache=c["v_cache"][:2]), FlashAttnArgumentError,
                              "k_cache has 2 rows .* for batch_size 3"),
    "k_cache-head-size": (lambda c: dict(k_cache=c["k_cache"][..., :16], v_cache=c["v_cache"][..., :16]),
                          FlashAttnArgumentError, "q and k_cache must have the same head size, got 32 and 16"),
    "v_cache-shape": (lambda c: dict(v_cache=c["v_cache"][:, :8]), FlashAttnArgumentError,
                      "k_cache and v_cache must have the same shape"),
    "window-triple": (lambda c: dict(window_size=(1, 2, 3)), FlashAttnArgumentError,
                      r"window_size must be a pair of ints \(left, right\), got \(1, 2, 3\)"),
}


@pytest.mark.parametrize("case", list(KVCACHE_ERRORS))
def test_kvcache_errors_name_the_argument_before_any_write(case):
    change, error, message = KVCACHE_ERRORS[case]
    call, _ = kvcache_case(torch.Generator().manual_seed(21), "cpu", new=3, **KVCACHE_LAYOUTS["leftpad"])
    before = call["k_cache"].clone(), call["v_cache"].clone()
    with pytest.raises(error, match=message) as raised:
        flash_attn_with_kvcache(**{**call, **change(call)})
    for internal in ("block_table", "slot_mapping", "seq_lens", "cu_seqlens"):  # never passed by the user
        assert internal not in str(raised.value)
    assert torch.equal(call["k_cache"], before[0]) and torch.equal(call["v_cache"], before[1])


def test_varlen_errors_name_the_argument():
    q, k, v, cu_q, cu_k = varlen_batch(torch.Generator().manual_seed(22), "cpu")
    for args, message in (
        ((cu_q[None], cu_k[None]), r"cu_seqlens_q must be a 1-D int32 tensor .* got a tensor of shape \(1, 4\)"),
        ((cu_q[:0], cu_k[:0]), r"cu_seqlens_q must be a 1-D int32 tensor of batch_size \+ 1 >= 1 entries, got a "
                               r"tensor of shape \(0,\)"),
        ((cu_q, cu_k.to("meta")), "cu_seqlens_k must be on q's device cpu, got cu_seqlens_k on meta"),
    ):
        with pytest.raises(FlashAttnArgumentError, match=message):
            flash_attn_varlen_func(q, k, v, *args, 7, 10)
    with pytest.raises(FlashAttnArgumentError, match="softmax_scale must be a real number or None, got str"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 10, softmax_scale="0.1")
    with pytest.raises(FlashAttnArgumentError, match="window_size must be a pair"):
        flash_attn_func(q[None], k[None], v[None], window_size=(1, 2, 3))


def test_varlen_without_sequences():
    """``cu_seqlens == [0]``: no sequence; every row (if any) is padding: zeros, lse ``+inf``."""
    q, k, v, _, _ = varlen_batch(torch.Generator().manual_seed(23), "cpu")
    cu = torch.zeros(1, dtype=torch.int32)
    out, lse, _ = flash_attn_varlen_func(q[:0], k[:0], v[:0], cu, cu, 0, 0, return_attn_probs=True)
    assert out.shape == (0, H, D) and lse.shape == (H, 0)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 0, 0, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and not out.any()
    assert lse.shape == (H, q.shape[0]) and torch.isinf(lse).all() and (lse > 0).all()
