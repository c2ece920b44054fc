"""The Triton CUDA kernels at real sizes, through the registered ops, and under CUDA graphs.

Run on the H200 with ``pytest -m gpu`` (``profiling/gpu_suite.sh``). Real sizes (head sizes
64/128/256, and 72/111 that the kernels pad, block sizes 16/32/64, contexts up to 32k) compare
with ``compiled_attn.ops.reference`` run in float64 on the GPU: that reference is itself checked
against the float64 oracle of ``tests/oracle.py`` by ``test_ops_attention.py``, and the
oracle's per-cell Python loops are too slow at these sizes (small shapes against the oracle
itself run on the GPU from ``test_triton_interpret.py``). Every output is poisoned with NaN
first; inputs are fresh random values; cache slots no sequence owns hold NaN.

Each op is also captured once in a ``torch.cuda.CUDAGraph`` and replayed after its metadata
tensors change (new lengths, new block tables, new query partition, padded rows); replays
must equal eager calls bit for bit and the float64 reference within tolerance.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (run on the H200: profiling/gpu_suite.sh)"),
]
pytest.importorskip("triton", reason="Triton is not installed: these tests exercise Triton kernels")

from oracle import assert_close_to_oracle  # noqa: E402
from paged_batches import alibi_slopes, make_lambda, make_paged_batch, pad, randn_nonzero  # noqa: E402

import compiled_attn.ops as ops  # noqa: E402
from compiled_attn.ops import reference, triton_kernels  # noqa: E402
from compiled_attn.ops.attention import output_shape  # noqa: E402
from compiled_attn.ops.triton_kernels.attention import launch_plan  # noqa: E402

NUM_HEADS, NUM_KV_HEADS = 32, 8
MIXED = [(0, 257), (1500, 64), (1023, 1), (8191, 1), (32767, 1), (4000, 4), pad(1), (100, 0)]
DECODE = [(0, 1), (1000, 1), (8191, 1), (32767, 1), pad(1), (20000, 1)]


@functools.lru_cache(maxsize=8)
def real_batch(seqs, head_size, block_size, dtype):
    batch = make_paged_batch(list(seqs), block_size=block_size, num_heads=NUM_HEADS,
                             num_kv_heads=NUM_KV_HEADS, head_size=head_size, dtype=dtype,
                             seed=head_size + block_size, unused_fill="nan")
    return [t.cuda() for t in batch.attention_args()], batch.pad_rows


def reference_paged(args, lambda_full=None, scale=None, causal=True, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None):
    query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table = args
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return reference.paged_attention(
        query.double(), key_cache.double(), value_cache.double(), cu_seqlens_q, seq_lens,
        block_table, lambda_full, scale, causal, *window_size, softcap, alibi_slopes)


def reference_varlen(args, lambda_full=None, causal=True):
    q, k, v, cu_seqlens_q, cu_seqlens_k = args
    return reference.varlen_attention(q.double(), k.double(), v.double(), cu_seqlens_q,
                                      cu_seqlens_k, lambda_full, q.shape[-1] ** -0.5, causal,
                                      -1, -1, 0.0, None)


def check_paged(args, pad_rows, lambda_full=None, **options):
    """Kernel (NaN-poisoned ``out``) vs float64 reference; padded rows exact zeros."""
    out = torch.full(output_shape(args[0], lambda_full is not None), float("nan"),
                     dtype=args[0].dtype, device="cuda")
    launch = {k: v for k, v in options.items() if k != "window_size"}
    window_left, window_right = options.get("window_size", (-1, -1))
    triton_kernels.paged_attention(*args, lambda_full, out=out, window_left=window_left,
                                   window_right=window_right, **launch)
    assert_close_to_oracle(out, reference_paged(args, lambda_full, **options))
    assert bool((out[pad_rows] == 0).all())


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_paged_real_sizes(dtype, head_size, block_size, differential):
    if dtype == torch.float16 and block_size != 16:
        pytest.skip("float16 runs at block size 16 only (the dtype does not change addressing)")
    lam = make_lambda(NUM_HEADS, per_pair=True).cuda() if differential else None
    for seqs in (MIXED, DECODE):
        args, pad_rows = real_batch(tuple(seqs), head_size, block_size, dtype)
        check_paged(args, pad_rows, lam)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_decode_batch_takes_the_split_path(differential):
    """The heuristic splits the real-size decode batch above (so the split kernels ran)."""
    args, _ = real_batch(tuple(DECODE), 128, 16, torch.bfloat16)
    query, key_cache, _, _, seq_lens, block_table = args
    plan = launch_plan(query, NUM_KV_HEADS, seq_lens.shape[0],
                       block_table.shape[1] * key_cache.shape[1], differential)
    assert plan.num_splits > 1


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_paged_real_sizes_options(differential):
    """Sliding window (early splits of long rows see nothing), softcap and ALiBi."""
    lam = make_lambda(NUM_HEADS, per_pair=False).cuda() if differential else None
    slopes = alibi_slopes(NUM_HEADS).cuda()
    for seqs in (MIXED, DECODE):
        args, pad_rows = real_batch(tuple(seqs), 128, 16, torch.bfloat16)
        check_paged(args, pad_rows, lam, window_size=(1024, -1), softcap=30.0,
                    alibi_slopes=slopes)


@pytest.mark.parametrize("differential, route", [(False, "gluon"), (False, "hopper"), (False, "unified"),
                                               (True, "gluon"), (True, "hopper"), (True, "unified")])
def test_varlen_real_sizes(differential, route, monkeypatch):
    """D 128: the Gluon prefill kernel the launcher routes calls to on sm90
    (``GLUON_PREFILL``), the Hopper prefill kernel (``PREFILL_KERNEL``), and the unified kernel."""
    monkeypatch.setattr(triton_kernels.attention, "GLUON_PREFILL", route == "gluon")
    monkeypatch.setattr(triton_kernels.attention, "PREFILL_KERNEL", "hopper" if route == "gluon" else route)
    gluon_calls = count_gluon_calls(monkeypatch)
    g = torch.Generator().manual_seed(3)
    lens = [2048, 1000, 17, 1, 333]
    total = sum(lens)
    q = randn_nonzero((total, NUM_HEADS, 128), torch.bfloat16, g).cuda()
    k = randn_nonzero((total, NUM_KV_HEADS, 128), torch.bfloat16, g).cuda()
    v = randn_nonzero((total, NUM_KV_HEADS, 128), torch.bfloat16, g).cuda()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    lam = make_lambda(NUM_HEADS, per_pair=True).cuda() if differential else None
    for causal in (True, False):
        out = torch.full(output_shape(q, differential), float("nan"), dtype=q.dtype, device="cuda")
        triton_kernels.varlen_attention(q, k, v, cu, cu, lam, causal=causal, out=out)
        assert_close_to_oracle(out, reference_varlen((q, k, v, cu, cu), lam, causal))
    assert len(gluon_calls) == (2 if route == "gluon" else 0)


def count_gluon_calls(monkeypatch) -> list:
    """Record each launch of the Gluon prefill kernel by the ops (``gluon_prefill.launch``,
    reached through its module), varlen and paged."""
    gluon_prefill = triton_kernels.attention.gluon_prefill
    calls, launch = [], gluon_prefill.launch
    monkeypatch.setattr(gluon_prefill, "launch", lambda *a: calls.append(a) or launch(*a))
    return calls


ODD_MIXED = [(0, 100), (700, 17), (1023, 1), (4000, 3), pad(1), (50, 0)]
ODD_DECODE = [(0, 1), (1000, 1), (4095, 1), pad(1), (2500, 1)]


@pytest.mark.parametrize("head_size", [72, 111])
def test_odd_head_sizes(head_size):
    """Head sizes flash-attn accepts that are neither powers of two nor multiples of 8 (the
    kernels pad them): paged prefill and split decode, plain and differential, varlen, and
    ``reshape_and_cache``."""
    g = torch.Generator().manual_seed(head_size)
    lens = [300, 17, 1, 100]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    q = randn_nonzero((sum(lens), NUM_HEADS, head_size), torch.bfloat16, g).cuda()
    k, v = (randn_nonzero((sum(lens), NUM_KV_HEADS, head_size), torch.bfloat16, g).cuda() for _ in range(2))
    for differential in (False, True):
        lam = make_lambda(NUM_HEADS, per_pair=True).cuda() if differential else None
        for seqs in (ODD_MIXED, ODD_DECODE):
            args, pad_rows = real_batch(tuple(seqs), head_size, 16, torch.bfloat16)
            check_paged(args, pad_rows, lam)
        query, _, _, _, seq_lens, block_table = args
        assert launch_plan(query, NUM_KV_HEADS, seq_lens.shape[0], block_table.shape[1] * 16,
                           differential).num_splits > 1
        out = torch.full(output_shape(q, differential), float("nan"), dtype=q.dtype, device="cuda")
        triton_kernels.varlen_attention(q, k, v, cu, cu, lam, out=out)
        assert_close_to_oracle(out, reference_varlen((q, k, v, cu, cu), lam))
    batch = make_paged_batch([(0, 5), (9, 3), pad(2)], num_heads=4, num_kv_heads=2, head_size=head_size,
                             dtype=torch.bfloat16, seed=head_size)
    key_cache, value_cache = (c.cuda() for c in batch.caches_before_write())
    triton_kernels.reshape_and_cache(batch.key.cuda(), batch.value.cuda(), key_cache, value_cache,
                                     batch.slot_mapping.cuda())
    assert torch.equal(key_cache.cpu(), batch.key_cache)
    assert torch.equal(value_cache.cpu(), batch.value_cache)


# --- registration: the CUDA path of the ops is the Triton kernels --------------------------


def small_paged_args():
    batch = make_paged_batch([(0, 20), (37, 5), (50, 1), pad(1)], num_heads=8, num_kv_heads=4,
                             head_size=64, dtype=torch.bfloat16, seed=1)
    return batch, [t.cuda() for t in batch.attention_args()]


def test_ops_dispatch_to_triton_on_cuda():
    """Bit-equal to the launcher (the float32 reference would round differently)."""
    _, args = small_paged_args()
    lam = make_lambda(8, per_pair=True).cuda()
    assert torch.equal(ops.paged_attention(*args), triton_kernels.paged_attention(*args))
    assert torch.equal(ops.paged_attention(*args, lam), triton_kernels.paged_attention(*args, lam))
    assert not torch.equal(ops.paged_attention(*args),
                           reference.paged_attention(*args, None, 64 ** -0.5, True, -1, -1, 0.0, None))


def test_opcheck_cuda():
    batch, args = small_paged_args()
    lam = make_lambda(8, per_pair=True).cuda()
    options = (64 ** -0.5, True, -1, -1, 0.0, None, None)
    torch.library.opcheck(torch.ops.compiled_attn.paged_attention.default, (*args, None, *options))
    torch.library.opcheck(torch.ops.compiled_attn.paged_attention.default, (*args, lam, *options))
    tensor_scalars = (*options[:-1], torch.tensor([64 ** -0.5, 0.0], device="cuda"))
    torch.library.opcheck(torch.ops.compiled_attn.paged_attention.default, (*args, lam, *tensor_scalars))
    key_cache, value_cache = (c.cuda() for c in batch.caches_before_write())
    torch.library.opcheck(torch.ops.compiled_attn.reshape_and_cache.default,
                          (batch.key.cuda(), batch.value.cuda(), key_cache, value_cache,
                           batch.slot_mapping.cuda()))


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_per_call_scale_and_softcap_under_compile_on_cuda(differential):
    """The scale case on CUDA: per-call floats reach the kernel as a tensor (no recompile
    after the first change), results equal to eager calls."""
    from torch._dynamo.utils import counters

    _, args = small_paged_args()
    lam = make_lambda(8, per_pair=True).cuda() if differential else None
    f = torch.compile(lambda s, c: ops.paged_attention(*args, lam, scale=s, softcap=c), fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    for scale, softcap in ((0.125, 0.0), (0.1, 5.0), (0.2, 0.0), (0.15, 2.5)):
        torch.testing.assert_close(f(scale, softcap), ops.paged_attention(*args, lam, scale=scale, softcap=softcap),
                                   atol=2e-2, rtol=2e-2)
    assert counters["stats"]["unique_graphs"] - before <= 2


# --- CUDA graphs: capture once, replay with new metadata ----------------------------------


class PagedPool:
    """A fixed-shape paged batch whose metadata is redrawn each round (graph replay)."""

    def __init__(self, num_tokens, num_seqs, width, head_size, block_size, seed):
        self.g = torch.Generator().manual_seed(seed)
        self.num_tokens, self.num_seqs, self.width, self.block_size = num_tokens, num_seqs, width, block_size
        self.num_blocks = num_seqs * width + 3
        cache_shape = (self.num_blocks, block_size, NUM_KV_HEADS, head_size)
        self.static = [
            torch.empty((num_tokens, NUM_HEADS, head_size), dtype=torch.bfloat16, device="cuda"),
            torch.empty(cache_shape, dtype=torch.bfloat16, device="cuda"),
            torch.empty(cache_shape, dtype=torch.bfloat16, device="cuda"),
            torch.empty(num_seqs + 1, dtype=torch.int32, device="cuda"),
            torch.empty(num_seqs, dtype=torch.int32, device="cuda"),
            torch.empty((num_seqs, width), dtype=torch.int32, device="cuda"),
        ]

    def redraw(self, query_lens, padded=()):
        """New values in the static tensors: ``query_lens`` (sum = num_tokens), random
        contexts, a random block permutation; rows in ``padded`` get ``seq_len`` 0."""
        assert sum(query_lens) == self.num_tokens and len(query_lens) == self.num_seqs
        g = self.g
        query, key_cache, value_cache, cu, seq_lens, table = self.static
        max_len = self.width * self.block_size
        lens = [0 if b in padded else int(torch.randint(q, max_len + 1, (), generator=g))
                for b, q in enumerate(query_lens)]
        cu_host = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        perm = torch.randperm(self.num_blocks, generator=g)[: self.num_seqs * self.width]
        for dst, shape in ((query, query.shape), (key_cache, key_cache.shape),
                           (value_cache, value_cache.shape)):
            dst.copy_(randn_nonzero(shape, torch.bfloat16, g))
        cu.copy_(cu_host)
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        table.copy_(perm.reshape(self.num_seqs, self.width).to(torch.int32))
        return [sum(query_lens[:b]) + i for b in padded for i in range(query_lens[b])]


def capture(fn):
    """Warm up ``fn`` on a side stream, then capture it; returns (graph, static output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("phase", ["decode", "mixed"])
def test_cuda_graph_paged(phase, differential):
    num_seqs = 6
    num_tokens = num_seqs if phase == "decode" else 40
    pool = PagedPool(num_tokens, num_seqs, width=256, head_size=128, block_size=16, seed=7)
    lam = torch.empty(NUM_HEADS // 2, device="cuda") if differential else None
    if phase == "decode":
        rounds = [([1] * 6, ()), ([1] * 6, (2, 5)), ([1] * 6, ())]
        plan = launch_plan(pool.static[0], NUM_KV_HEADS, num_seqs, 256 * 16, differential)
        assert plan.num_splits > 1  # the split path is captured
    else:
        rounds = [([30, 1, 1, 4, 2, 2], ()), ([1, 1, 33, 1, 1, 3], (4,)), ([5, 5, 5, 5, 10, 10], (0,))]
    pool.redraw(*rounds[0])
    if lam is not None:
        lam.copy_(make_lambda(NUM_HEADS, per_pair=True, seed=0))
    graph, out = capture(lambda: ops.paged_attention(*pool.static, lam))
    for seed, (query_lens, padded) in enumerate(rounds):
        pad_rows = pool.redraw(query_lens, padded)
        if lam is not None:
            lam.copy_(make_lambda(NUM_HEADS, per_pair=True, seed=seed))
        out.fill_(float("nan"))
        graph.replay()
        eager = ops.paged_attention(*pool.static, lam)
        assert torch.equal(out, eager), f"round {seed}: replay differs from eager"
        assert_close_to_oracle(out, reference_paged(pool.static, lam))
        assert bool((out[pad_rows] == 0).all())


@pytest.mark.parametrize("differential, gluon", [(False, True), (False, False), (True, True), (True, False)],
                         ids=["plain-gluon", "plain", "differential-gluon", "differential"])
def test_cuda_graph_varlen(differential, gluon, monkeypatch):
    """Calls on the Gluon prefill kernel (``GLUON_PREFILL``) and on the unified kernel."""
    monkeypatch.setattr(triton_kernels.attention, "GLUON_PREFILL", gluon)
    gluon_calls = count_gluon_calls(monkeypatch)
    g = torch.Generator().manual_seed(11)
    total_q, total_k, num_seqs = 64, 96, 4
    q = torch.empty((total_q, NUM_HEADS, 64), dtype=torch.bfloat16, device="cuda")
    k = torch.empty((total_k, NUM_KV_HEADS, 64), dtype=torch.bfloat16, device="cuda")
    v = torch.empty_like(k)
    cu_q = torch.empty(num_seqs + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.empty_like(cu_q)
    lam = torch.full((), 0.4, device="cuda") if differential else None

    def redraw(q_lens, k_lens):
        for t in (q, k, v):
            t.copy_(randn_nonzero(t.shape, torch.bfloat16, g))
        cu_q.copy_(torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32))
        cu_k.copy_(torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32))

    rounds = [([16, 16, 16, 16], [24, 24, 24, 24]), ([1, 60, 2, 1], [10, 70, 16, 0]),
              ([40, 0, 20, 4], [40, 6, 20, 30])]
    redraw(*rounds[0])
    graph, out = capture(lambda: ops.varlen_attention(q, k, v, cu_q, cu_k, lam))
    for number, lens in enumerate(rounds):
        redraw(*lens)
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, ops.varlen_attention(q, k, v, cu_q, cu_k, lam)), f"round {number}"
        assert_close_to_oracle(out, reference_varlen((q, k, v, cu_q, cu_k), lam))
    assert bool(gluon_calls) == gluon  # the route this case is about ran (captured and eager)


def test_cuda_graph_reshape_and_cache():
    g = torch.Generator().manual_seed(5)
    num_tokens, num_blocks, block_size = 12, 10, 16
    key = torch.empty((num_tokens, NUM_KV_HEADS, 128), dtype=torch.bfloat16, device="cuda")
    value = torch.empty_like(key)
    key_cache = torch.empty((num_blocks, block_size, NUM_KV_HEADS, 128), dtype=torch.bfloat16,
                            device="cuda")
    value_cache = torch.empty_like(key_cache)
    slots = torch.empty(num_tokens, dtype=torch.int64, device="cuda")

    def redraw():
        for t in (key, value, key_cache, value_cache):
            t.copy_(randn_nonzero(t.shape, torch.bfloat16, g))
        chosen = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
        chosen[torch.rand(num_tokens, generator=g) < 0.3] = -1
        slots.copy_(chosen)
        expected = (key_cache.clone(), value_cache.clone())
        reference.reshape_and_cache(key, value, *expected, slots)
        return expected

    redraw()
    graph, _ = capture(lambda: ops.reshape_and_cache(key, value, key_cache, value_cache, slots))
    for _ in range(3):
        expected_k, expected_v = redraw()
        graph.replay()
        assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


# --- fp8 KV cache (float8_e4m3fn, vLLM's kv_cache_dtype="fp8") ----------------------------------


@functools.lru_cache(maxsize=4)
def fp8_real_batch(seqs, head_size, dtype):
    """``real_batch`` with its caches quantized to float8_e4m3fn (scales as
    ``calibrate_kv_scales``: the largest finite magnitude maps to 448; unused slots stay NaN)."""
    args, pad_rows = real_batch(seqs, head_size, 16, dtype)
    query, key_cache, value_cache, *meta = args
    scales = [torch.nan_to_num(c, nan=0.0).abs().amax().float() / 448 for c in (key_cache, value_cache)]
    fp8 = [reference.quantize(c, s) for c, s in zip((key_cache, value_cache), scales)]
    return (query, *fp8, *meta), (key_cache, value_cache), scales, pad_rows


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp8_paged_real_sizes(dtype, head_size, differential):
    """The op over an fp8 cache at real sizes (prefill, chunked, decode to 32k keys, split
    decode): against the float64 reference over the dequantized cache (exact semantics, the
    query dtype's tolerances), and against the float64 reference over the unquantized
    cache within a relative L2 error of 2^-3 (twice e4m3's rounding of one element)."""
    lam = make_lambda(NUM_HEADS, per_pair=True).cuda() if differential else None
    for seqs in (MIXED, DECODE):
        args, exact, (k_scale, v_scale), pad_rows = fp8_real_batch(tuple(seqs), head_size, dtype)
        query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_table = args
        out = ops.paged_attention(*args, lam, k_scale=k_scale, v_scale=v_scale)
        assert torch.equal(out, triton_kernels.paged_attention(*args, lam, k_scale=k_scale, v_scale=v_scale))
        expected = reference.paged_attention(query.double(), key_cache, value_cache, cu_seqlens_q, seq_lens,
                                             block_table, lam, head_size ** -0.5, True, -1, -1, 0.0, None,
                                             k_scale, v_scale)
        assert_close_to_oracle(out, expected)
        assert bool((out[pad_rows] == 0).all())
        unquantized = reference_paged((query, *exact, cu_seqlens_q, seq_lens, block_table), lam)
        rel_l2 = ((out.double() - unquantized).norm() / unquantized.norm()).item()
        assert 0 < rel_l2 <= 2 ** -3, f"fp8 vs unquantized cache: relative L2 {rel_l2:.3g}"


def test_fp8_reshape_and_cache_bit_exact_on_cuda():
    """The kernel's integer float8 encoding equals torch's CUDA conversion (round to nearest
    even) after the saturation to +-448, for every input dtype, with and without scales
    (NaNs: same positions; their sign bit differs between torch's conversion paths)."""
    g = torch.Generator().manual_seed(21)
    num_tokens, block_size, num_blocks = 500, 16, 64
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        key = (torch.randn(num_tokens, NUM_KV_HEADS, 128, generator=g)
               * 10.0 ** torch.randint(-6, 4, (num_tokens, NUM_KV_HEADS, 1), generator=g)).to(dtype)
        key.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -1e30]).to(dtype)
        value = -key.flip(0)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
        slots[::7] = -1
        key, value, slots = key.cuda(), value.cuda(), slots.cuda()
        for scales in ((None, None), (torch.tensor(0.013), torch.tensor([7.0]))):
            k_scale, v_scale = (None if s is None else s.cuda() for s in scales)
            caches = [torch.zeros(num_blocks, block_size, NUM_KV_HEADS, 128, dtype=torch.float8_e4m3fn,
                                  device="cuda") for _ in range(4)]
            triton_kernels.reshape_and_cache(key, value, *caches[:2], slots, k_scale, v_scale)
            reference.reshape_and_cache(key, value, *caches[2:], slots, k_scale, v_scale)
            for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
                # A NaN's sign is not kept by every torch conversion path (float32 takes the
                # hardware's canonical 0x7F): NaN positions must agree, every other byte equal.
                nan = want.float().isnan()
                assert torch.equal(got.float().isnan(), nan), f"{dtype} {scales}: NaN positions"
                got_bytes, want_bytes = got.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]
                differ = (got_bytes != want_bytes).nonzero()[:5, 0]
                assert differ.numel() == 0, (f"{dtype} {scales}: bytes {got_bytes[differ].tolist()} "
                                             f"!= {want_bytes[differ].tolist()} at {differ.tolist()}")


def test_cuda_graph_fp8_decode_reads_the_scales_at_replay():
    """A captured fp8 decode (split) reads k_scale/v_scale from device memory: after the
    scales change in place, the replay equals an eager call with the new scales."""
    args, _, _, _ = fp8_real_batch(tuple(DECODE), 128, torch.bfloat16)
    query, key_cache, value_cache, *meta = (t.clone() for t in args)
    k_scale, v_scale = torch.tensor(0.01, device="cuda"), torch.tensor([0.02], device="cuda")
    lam = make_lambda(NUM_HEADS, per_pair=True).cuda()
    graph, out = capture(lambda: ops.paged_attention(query, key_cache, value_cache, *meta, lam,
                                                     k_scale=k_scale, v_scale=v_scale))
    for new in ((0.01, 0.02), (0.5, 0.003)):
        k_scale.fill_(new[0])
        v_scale.fill_(new[1])
        out.fill_(float("nan"))
        graph.replay()
        eager = ops.paged_attention(query, key_cache, value_cache, *meta, lam, k_scale=k_scale, v_scale=v_scale)
        assert torch.equal(out, eager)


def test_opcheck_fp8_cuda():
    args, _, (k_scale, v_scale), _ = fp8_real_batch(tuple(DECODE[:3]), 64, torch.bfloat16)
    options = (64 ** -0.5, True, -1, -1, 0.0, None, None)
    # test_schema compares arguments with torch.allclose, which float8 lacks
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.compiled_attn.paged_attention.default,
                          (*args, None, *options, k_scale, v_scale), test_utils=utils)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_fp8_under_compile_on_cuda(differential):
    """Static CUDA shapes trace the launcher into Inductor's code (wrap_triton) with the
    scales as pointer arguments: as eager (within test_gpu_compile.py's 1e-2: Inductor compiles
    the kernel with its own options); new scale values need no recompile."""
    from torch._dynamo.utils import counters

    batch, args = small_paged_args()
    query, key_cache, value_cache, *meta = args
    k_scale, v_scale = torch.tensor(0.02, device="cuda"), torch.tensor(0.03, device="cuda")
    fp8 = [reference.quantize(c, s) for c, s in ((key_cache, k_scale), (value_cache, v_scale))]
    lam = make_lambda(8, per_pair=True).cuda() if differential else None
    f = torch.compile(lambda ks, vs: ops.paged_attention(query, *fp8, *meta, lam, k_scale=ks, v_scale=vs),
                      fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    for scales in ((0.02, 0.03), (0.5, 0.001)):
        k_scale.fill_(scales[0])
        v_scale.fill_(scales[1])
        torch.testing.assert_close(f(k_scale, v_scale), ops.paged_attention(query, *fp8, *meta, lam, k_scale=k_scale,
                                                                            v_scale=v_scale), atol=1e-2, rtol=0)
    assert counters["stats"]["unique_graphs"] - before <= 1
