"""DifferentialAttention and Attention against naive float64 implementations written here
from the paper (Ye et al., "Differential Transformer", arXiv 2410.05258, sections 2.1 and
2.2), run over a paged cache through prefill, decode, chunked-prefill and mixed steps.

Head layout (see compiled_attn.layers.differential): query heads 2j / 2j+1 are components 1 / 2 of pair j, KV heads
2m / 2m+1 components 1 / 2 of KV pair m, and query pair j reads KV pair j // (H / Hkv).
"""

from __future__ import annotations

import math

import pytest
import torch

from compiled_attn.kv_cache import BlockAllocator, KVCache
from compiled_attn.layers import Attention, DifferentialAttention, lambda_init_for_depth
from compiled_attn.metadata import SequenceChunk, build_metadata

HIDDEN, HEAD = 64, 16
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 24, 8
THETA = 10000.0


# --- naive float64 references --------------------------------------------------------------


def linear(x, lin):
    w = lin.weight.detach().double()
    b = None if lin.bias is None else lin.bias.detach().double()
    return x @ w.T + (0 if b is None else b)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float | None) -> torch.Tensor:
    """Rotate-half RoPE: pair (i, i + D/2) rotated by position * base^(-2i/D)."""
    if base is None:
        return x
    d = x.shape[-1]
    half = d // 2
    out = x.clone()
    for i in range(half):
        angle = positions.double() * base ** (-2.0 * i / d)
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * cos - b * sin
        out[..., i + half] = b * cos + a * sin
    return out


def mask(length: int, window: int | None) -> torch.Tensor:
    """Causal (and sliding window of ``window`` tokens incl. self) visibility, [L, L]."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    visible = j <= i
    if window is not None:
        visible &= j > i - window
    return visible


def softmax_attn(q, k, window):
    """softmax(q k^T / sqrt(d)) with the causal (+window) mask; q, k: [L, D]."""
    scores = q @ k.T / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask(q.shape[0], window), float("-inf"))
    return torch.softmax(scores, dim=-1)


def project_qkv(q_layer, x_q, kv_layer, x_kv, positions, base):
    """Rows of ``qkv_proj`` are ``[Q | K | V]``; a KV-sharing layer has only ``q_proj``."""
    H, Hkv = q_layer.num_heads, kv_layer.num_kv_heads
    q = linear(x_q, q_layer.q_proj if q_layer.shares_kv_cache else q_layer.qkv_proj)[:, :H * HEAD]
    kv = linear(x_kv, kv_layer.qkv_proj)[:, kv_layer.num_heads * HEAD:]
    q = rope(q.reshape(len(x_q), H, HEAD), positions, base)
    k = rope(kv[:, :Hkv * HEAD].reshape(len(x_kv), Hkv, HEAD), positions, base)
    v = kv[:, Hkv * HEAD:].reshape(len(x_kv), Hkv, HEAD)
    return q, k, v


def naive_differential(layer, x, *, kv_layer=None, x_kv=None, lambda_init=None, window=None,
                       base=THETA, eps=1e-5):
    """The whole sequence ``x`` [L, hidden] through differential attention, float64."""
    kv_layer = kv_layer or layer
    x = x.double()
    x_kv = x.double() if x_kv is None else x_kv.double()
    positions = torch.arange(len(x))
    q, k, v = project_qkv(layer, x, kv_layer, x_kv, positions, base)
    pairs, kv_pairs = layer.num_heads // 2, kv_layer.num_kv_heads // 2
    group = pairs // kv_pairs
    lq1, lk1, lq2, lk2 = (getattr(layer, n).detach().double() for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"))
    lam = torch.exp(lq1 @ lk1) - torch.exp(lq2 @ lk2) + (layer.lambda_init if lambda_init is None else lambda_init)
    lambda_init = layer.lambda_init if lambda_init is None else lambda_init
    outs = []
    for j in range(pairs):
        m = j // group
        q1, q2 = q[:, 2 * j], q[:, 2 * j + 1]
        k1, k2 = k[:, 2 * m], k[:, 2 * m + 1]
        value = torch.cat([v[:, 2 * m], v[:, 2 * m + 1]], dim=-1)  # [L, 2D]
        head = softmax_attn(q1, k1, window) @ value - lam * (softmax_attn(q2, k2, window) @ value)
        head = head / torch.sqrt(head.pow(2).mean(-1, keepdim=True) + eps)  # subln over 2D
        if layer.subln.weight is not None:
            head = head * layer.subln.weight.detach().double()
        outs.append(head * (1 - lambda_init))
    return linear(torch.cat(outs, dim=-1), layer.o_proj)


def naive_plain(layer, x, *, window=None, base=THETA):
    x = x.double()
    positions = torch.arange(len(x))
    q, k, v = project_qkv(layer, x, layer, x, positions, base)
    group = layer.num_heads // layer.num_kv_heads
    outs = [softmax_attn(q[:, h], k[:, h // group], window) @ v[:, h // group] for h in range(layer.num_heads)]
    return linear(torch.cat(outs, dim=-1), layer.o_proj)


# --- driving a layer over a paged cache ----------------------------------------------------


class PagedRun:
    """Feeds hidden states of several sequences step by step through ``layers`` (each with
    its cache pair), keeping every sequence's full input for the naive recompute."""

    def __init__(self, num_kv_heads: int, num_caches: int = 1):
        self.cache = KVCache.allocate(num_caches, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD, torch.float32, "cpu")
        self.alloc: BlockAllocator = self.cache.allocator
        # Take a few blocks first so tables do not start at 0 and are not contiguous.
        self.alloc.allocate(999, 3)
        self.inputs: dict[int, list[torch.Tensor]] = {}

    def step(self, new_tokens: dict[int, int], gen: torch.Generator, width: int = HIDDEN):
        """``{seq: query_len}`` -> (metadata, hidden [T, width], per-seq (context, q_len))."""
        chunks, hidden, spans = [], [], {}
        for seq, q_len in new_tokens.items():
            context = sum(len(t) for t in self.inputs.get(seq, []))
            table = self.alloc.allocate(seq, context + q_len)
            x = torch.randn(q_len, width, generator=gen)
            self.inputs.setdefault(seq, []).append(x)
            chunks.append(SequenceChunk([0] * q_len, context, list(table)))
            hidden.append(x)
            spans[seq] = (context, q_len)
            if q_len > 1:  # interleave allocations so block ids of a sequence are scattered
                self.alloc.allocate(1000 + seq * 10 + context, 1)
        md = build_metadata(chunks, BLOCK_SIZE, MAX_BLOCKS, "cpu", NUM_BLOCKS)
        return md, torch.cat(hidden), spans

    def full_input(self, seq: int) -> torch.Tensor:
        return torch.cat(self.inputs[seq])


STEPS = [
    {0: 6, 1: 3},  # prefill of two sequences (pure prefill: varlen path)
    {0: 1, 1: 1},  # decode
    {0: 1, 1: 1},  # decode, seq 1 crosses into its second block
    {0: 3, 1: 1},  # chunked prefill of seq 0 mixed with a decode
    {2: 5, 0: 1},  # a new sequence's prefill (context 0) in a mixed batch
    {1: 2, 2: 1, 0: 1},  # multi-token decode, decodes
]


def check_steps(layer, naive, num_kv_heads, steps=STEPS, seed=0, atol=2e-5, rtol=1e-4):
    gen = torch.Generator().manual_seed(seed)
    run = PagedRun(num_kv_heads)
    kv = run.cache.layers[0]
    for n, step in enumerate(steps):
        md, hidden, spans = run.step(step, gen)
        with torch.no_grad():
            out = layer(hidden, md, kv)
        assert out.shape == hidden.shape and out.dtype == torch.float32
        start = 0
        for seq, (context, q_len) in spans.items():
            expected = naive(layer, run.full_input(seq))[context:context + q_len]
            torch.testing.assert_close(out[start:start + q_len].double(), expected, atol=atol, rtol=rtol,
                                       msg=lambda m: f"step {n} seq {seq}: {m}")
            start += q_len


def cacheless_md(lengths):
    """Metadata of pure prefills (block tables only to satisfy build_metadata)."""
    chunks, first = [], 0
    for n in lengths:
        blocks = -(-n // BLOCK_SIZE)
        chunks.append(SequenceChunk([0] * n, 0, list(range(first, first + blocks))))
        first += blocks
    return build_metadata(chunks, BLOCK_SIZE, MAX_BLOCKS)


# --- DifferentialAttention -----------------------------------------------------------------


def make_diff(num_heads=4, num_kv_heads=2, seed=0, **kwargs):
    torch.manual_seed(seed)
    kwargs.setdefault("lambda_std", 0.4)
    layer = DifferentialAttention(HIDDEN, num_heads, num_kv_heads, HEAD, **kwargs)
    if layer.subln.weight is not None:
        with torch.no_grad():
            layer.subln.weight.uniform_(0.5, 1.5)
    return layer.eval()


@pytest.mark.parametrize(
    "num_heads, num_kv_heads, kwargs",
    [
        (4, 2, {}),  # GQA group 2, DiffLlama style (no subln weight)
        (4, 4, {"subln_affine": True, "bias": True, "depth": 3}),
        (8, 2, {"depth": 7}),  # group 4
    ],
)
def test_differential_matches_naive_over_paged_steps(num_heads, num_kv_heads, kwargs):
    layer = make_diff(num_heads, num_kv_heads, **kwargs)
    check_steps(layer, naive_differential, num_kv_heads)


def test_differential_cacheless_forward_matches_naive():
    layer = make_diff(4, 2, subln_affine=True)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, HIDDEN, generator=gen) for n in (5, 1, 9)]
    md = cacheless_md([len(x) for x in xs])
    with torch.no_grad():
        out = layer(torch.cat(xs), md, None)
    expected = torch.cat([naive_differential(layer, x) for x in xs])
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


def test_lambda_is_recomputed_every_forward():
    layer = make_diff(4, 2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, HIDDEN, generator=gen)
    md = cacheless_md([7])
    lam_before = float(layer.lambda_full().detach())
    with torch.no_grad():
        before = layer(x, md, None)
        layer.lambda_q1.add_(0.7)  # in place: same Parameter object, new values
        after = layer(x, md, None)
    lq1, lk1, lq2, lk2 = (getattr(layer, n).detach().double() for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"))
    expected_lam = float(torch.exp(lq1 @ lk1) - torch.exp(lq2 @ lk2) + layer.lambda_init)
    assert layer.lambda_full().shape == () and layer.lambda_full().dtype == torch.float32
    assert float(layer.lambda_full().detach()) == pytest.approx(expected_lam, rel=1e-6)
    assert abs(expected_lam - lam_before) > 1e-2
    assert (after - before).abs().max() > 1e-3
    torch.testing.assert_close(after.double(), naive_differential(layer, x), atol=2e-5, rtol=1e-4)
    # ... also when the change goes through the paged path.
    check_steps(layer, naive_differential, 2, steps=STEPS[:3])


@pytest.mark.parametrize("depth", [0, 1, 2, 5, 11, 23])
def test_lambda_init_by_depth(depth):
    expected = 0.8 - 0.6 * math.exp(-0.3 * depth)
    assert lambda_init_for_depth(depth) == pytest.approx(expected, abs=1e-12)
    layer = DifferentialAttention(HIDDEN, 4, 2, HEAD, depth=depth)
    assert layer.lambda_init == pytest.approx(expected, abs=1e-12)
    assert DifferentialAttention(HIDDEN, 4, 2, HEAD, depth=depth, lambda_init=0.25).lambda_init == 0.25


def test_lambda_init_enters_lambda_and_output_scale():
    # depth 0 -> 0.2, depth 9 -> 0.76: the forward must use the layer's own value.
    for depth in (0, 9):
        layer = make_diff(4, 2, depth=depth, seed=4)
        x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(5))
        md = cacheless_md([6])
        with torch.no_grad():
            out = layer(x, md, None)
        lam0 = 0.8 - 0.6 * math.exp(-0.3 * depth)
        torch.testing.assert_close(out.double(), naive_differential(layer, x, lambda_init=lam0), atol=2e-5, rtol=1e-4)
        wrong = naive_differential(layer, x, lambda_init=0.8 - 0.6 * math.exp(-0.3 * (depth + 3)))
        assert (out.double() - wrong).abs().max() > 1e-3


def test_sliding_window_limits_attention():
    window = 3
    layer = make_diff(4, 2, sliding_window=window, seed=6)
    check_steps(layer, lambda lay, x: naive_differential(lay, x, window=window), 2)
    # Sanity: the window matters for these inputs.
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(0))
    assert (naive_differential(layer, x, window=window) - naive_differential(layer, x)).abs().max() > 1e-3


def test_plain_sliding_window_limits_attention():
    torch.manual_seed(7)
    layer = Attention(HIDDEN, 4, 2, HEAD, sliding_window=2).eval()
    check_steps(layer, lambda lay, x: naive_plain(lay, x, window=2), 2)


def test_kv_sharing_layer_reads_the_owner_cache():
    owner = make_diff(4, 2, seed=8)
    sharer = make_diff(4, 2, seed=9, shares_kv_cache=True, depth=2)
    assert not hasattr(sharer, "qkv_proj") and sharer.q_proj.weight.shape == (4 * HEAD, HIDDEN)
    assert not any("qkv_proj" in k or "k_proj" in k or "v_proj" in k for k in sharer.state_dict())
    gen = torch.Generator().manual_seed(3)
    run = PagedRun(2)
    kv = run.cache.layers[0]
    sharer_inputs: dict[int, list[torch.Tensor]] = {}
    for n, step in enumerate(STEPS):
        md, x_owner, spans = run.step(step, gen)
        x_sharer = torch.randn_like(x_owner)
        start = 0
        for seq, (_, q_len) in spans.items():
            sharer_inputs.setdefault(seq, []).append(x_sharer[start:start + q_len])
            start += q_len
        snapshot = [t.clone() for t in kv]
        with torch.no_grad():
            owner(x_owner, md, kv)
            written = [t.clone() for t in kv]
            out = sharer(x_sharer, md, kv)
        assert any(not torch.equal(a, b) for a, b in zip(snapshot, written))
        assert all(torch.equal(a, b) for a, b in zip(written, kv))  # the sharer writes nothing
        start = 0
        for seq, (context, q_len) in spans.items():
            expected = naive_differential(sharer, torch.cat(sharer_inputs[seq]), kv_layer=owner,
                                          x_kv=run.full_input(seq))[context:context + q_len]
            torch.testing.assert_close(out[start:start + q_len].double(), expected, atol=2e-5, rtol=1e-4,
                                       msg=lambda m: f"step {n} seq {seq}: {m}")
            start += q_len


def test_kv_sharing_layer_without_cache_raises():
    sharer = make_diff(4, 2, shares_kv_cache=True)
    md = cacheless_md([2])
    with pytest.raises(ValueError, match="kv_cache"):
        sharer(torch.randn(2, HIDDEN), md, None)


# --- plain Attention -----------------------------------------------------------------------


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (4, 1), (4, 4)])
def test_plain_attention_gqa_matches_naive(num_heads, num_kv_heads):
    torch.manual_seed(10)
    layer = Attention(HIDDEN, num_heads, num_kv_heads, HEAD, bias=True).eval()
    assert layer.qkv_proj.weight.shape == ((num_heads + 2 * num_kv_heads) * HEAD, HIDDEN)
    assert layer.qkv_proj.bias.shape == ((num_heads + 2 * num_kv_heads) * HEAD,)
    assert not hasattr(layer, "q_proj")
    check_steps(layer, naive_plain, num_kv_heads)


def test_plain_attention_without_rope():
    torch.manual_seed(11)
    layer = Attention(HIDDEN, 4, 2, HEAD, rope_theta=None).eval()
    assert layer.rotary is None
    check_steps(layer, lambda lay, x: naive_plain(lay, x, base=None), 2, steps=STEPS[:3])


# --- constructor errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, match",
    [
        ((HIDDEN, 3, 1, HEAD), r"num_heads=3"),  # odd num_heads
        ((HIDDEN, 6, 3, HEAD), r"num_kv_heads=3"),  # odd num_kv_heads
        ((HIDDEN, 4, 3, HEAD), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        ((HIDDEN, 4, 2, 257), r"head_size.*257"),
    ],
)
def test_differential_constructor_errors(args, match):
    with pytest.raises(ValueError, match=match):
        DifferentialAttention(*args)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((HIDDEN, 4, 3, HEAD), {}, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        ((HIDDEN, 4, 0, HEAD), {}, r"num_kv_heads \(0\)"),
        ((HIDDEN, 4, 2, 257), {}, r"head_size.*257"),
        ((HIDDEN, 4, 2, 264), {}, r"head_size.*264"),
        ((HIDDEN, 4, 2, HEAD), {"sliding_window": 0}, r"sliding_window"),
    ],
)
def test_attention_constructor_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Attention(*args, **kwargs)


def test_odd_head_counts_are_fine_for_plain_attention():
    layer = Attention(48, 3, 1, HEAD)
    assert layer.num_heads == 3 and layer.num_kv_heads == 1


def test_zero_heads_is_a_value_error_not_a_division_by_zero():
    with pytest.raises(ValueError, match="num_heads"):
        Attention(128, 0, 0)
