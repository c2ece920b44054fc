"""The flash-attn backend on a GPU with flash-attn 4 installed (``profiling/gpu_suite.sh flash``).

Our varlen op with the backend against the float64 reference and against our own Triton
kernel, plain and differential (two flash calls), GQA, windows and softcap; the backend's
choice per call; capture in a CUDA graph. The paged op's prefill-bearing calls through
flash-attn 4's page table (``page_table``/``seqused_k``): mixed chunked-prefill, prefix-hit,
decode and padded rows over a cache with NaN in every slot no sequence uses, against the
float64 reference (bottom-right causal alignment on ``seq_lens``) and our kernel, through the
op (its CUDA kernel), under ``torch.compile`` (the op stays opaque) and in a CUDA graph;
decode and what the backend does not cover bit-equal to our kernel. Skipped without CUDA or
without ``flash_attn.cute``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)"),
]
pytest.importorskip("flash_attn.cute", reason="needs flash-attn 4 (profiling/gpu_suite.sh flash carries it in)")

from oracle import assert_close_to_oracle, oracle_paged, oracle_varlen  # noqa: E402
from paged_batches import make_paged_batch, pad, randn_nonzero  # noqa: E402

from compiled_attn import ops  # noqa: E402
from compiled_attn.ops import flash_backend, triton_kernels  # noqa: E402


@pytest.fixture(autouse=True)
def any_size(monkeypatch):
    """The backend takes these small batches (``MIN_QUERY_TOKENS`` keeps calls under 4096
    query tokens on our kernel in use), and their differential calls at head size 128 (which
    our launcher keeps in use: ``flash_backend.hopper_takes``)."""
    monkeypatch.setattr(flash_backend, "MIN_QUERY_TOKENS", 1)
    monkeypatch.setattr(triton_kernels.attention, "PREFILL_HEAD_SIZES", frozenset())


def count_flash_calls(monkeypatch) -> list:
    """The backend's library with its varlen function counted: one entry a flash-attn call."""
    library = flash_backend.find_library()
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return library.varlen(*args, **kwargs)

    monkeypatch.setattr(flash_backend, "find_library", lambda: library._replace(varlen=counted))
    return calls


def batch(head_size=128):
    g = torch.Generator().manual_seed(head_size)
    lens = [1, 300, 1000, 77]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = randn_nonzero((sum(lens), 16, head_size), torch.bfloat16, g).cuda()
    k, v = (randn_nonzero((sum(lens), 4, head_size), torch.bfloat16, g).cuda() for _ in range(2))
    return q, k, v, cu


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("options", [dict(), dict(window_size=(64, 0), softcap=10.0), dict(causal=False)])
def test_op_through_flash_equals_reference_and_our_kernel(differential, options):
    q, k, v, cu = batch()
    lam = torch.rand(8, device="cuda") if differential else None
    assert flash_backend.covers(q, k, v, cu, cu, lam, None, True, -1, -1, 0.0, None, None)
    got = ops.varlen_attention(q, k, v, cu, cu, lam, **options)
    causal = options.get("causal", True)
    window = options.get("window_size", (-1, -1))
    softcap = options.get("softcap", 0.0)
    assert_close_to_oracle(got, oracle_varlen(q, k, v, cu, cu, None, causal, window, softcap, lambda_full=lam))
    ours = triton_kernels.varlen_attention(q, k, v, cu, cu, lam, None, causal, *window, softcap)
    torch.testing.assert_close(got, ours, atol=2e-2, rtol=2e-2)


def test_alibi_and_head_size_256_differential_stay_on_our_kernel():
    q, k, v, cu = batch(256)
    assert not flash_backend.covers(q, k, v, cu, cu, torch.tensor(0.5, device="cuda"), None, True, -1, -1, 0.0,
                                    None, None)
    q, k, v, cu = batch()
    assert not flash_backend.covers(q, k, v, cu, cu, None, None, True, -1, -1, 0.0, torch.ones(16, device="cuda"),
                                    None)


def test_differential_prefill_at_head_size_128_stays_ours(monkeypatch):
    """As shipped (``PREFILL_HEAD_SIZES`` holds 128, which the fixture empties for the other
    tests): the op runs a D 128 differential prefill on our kernels (the Gluon kernel's fused
    schedule on sm90, else the Hopper prefill kernel), measured faster than flash-attn 4's two
    calls, with no flash-attn call, and its plain prefill through flash-attn 4."""
    monkeypatch.setattr(triton_kernels.attention, "PREFILL_HEAD_SIZES", frozenset({128}))
    q, k, v, cu = batch()
    calls = count_flash_calls(monkeypatch)
    lam = torch.rand(8, device="cuda")
    got = ops.varlen_attention(q, k, v, cu, cu, lam)
    assert calls == []
    assert_close_to_oracle(got, oracle_varlen(q, k, v, cu, cu, None, True, (-1, -1), 0.0, lambda_full=lam))
    ops.varlen_attention(q, k, v, cu, cu)
    assert calls == [1]


def test_op_through_flash_captures_in_a_cuda_graph():
    q, k, v, cu = batch()
    lam = None
    eager = ops.varlen_attention(q, k, v, cu, cu, lam)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.compiled_attn.varlen_attention.default(q, k, v, cu, cu, lam, 128 ** -0.5, True, -1, -1, 0.0,
                                                               None, None)  # plain: through flash-attn 4
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.testing.assert_close(out, ops.varlen_attention(q, k, v, cu, cu, lam), atol=0, rtol=0)
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_compiled_public_op_at_default_options_runs_flash_attn(differential, monkeypatch):
    """``torch.compile`` of a user function calling ``ops.varlen_attention`` with the default
    scale and softcap: the op gets floats, stays opaque, and its CUDA kernel calls flash-attn
    4 (counted), with the eager result."""
    q, k, v, cu = batch()
    lam = torch.rand(8, device="cuda") if differential else None
    calls = count_flash_calls(monkeypatch)
    eager = ops.varlen_attention(q, k, v, cu, cu, lam)
    calls.clear()
    compiled = torch.compile(lambda q: ops.varlen_attention(q, k, v, cu, cu, lam) * 1.0, fullgraph=True)
    torch.testing.assert_close(compiled(q), eager, atol=0, rtol=0)
    assert len(calls) == (2 if differential else 1)


# --- paged prefill through flash-attn 4's page table -------------------------------------------

# fresh prefill, decode, chunked prefill (q_len < seq_len: bottom-right alignment), padded graph
# row (seq_len 0), long decode, prefix-cache hit: T = 444 > B = 6
MIXED = [(0, 300), (1000, 1), (500, 77), pad(1), (2000, 1), (130, 64)]
DECODE = [(0, 1), (1000, 1), pad(1), (2000, 1), (77, 1)]


def paged_batch(seqs=MIXED, block_size=16, head_size=128):
    batch = make_paged_batch(seqs, block_size=block_size, num_heads=16, num_kv_heads=4, head_size=head_size,
                             dtype=torch.bfloat16, seed=block_size + head_size, unused_fill="nan")
    return [t.cuda() for t in batch.attention_args()], batch.pad_rows


def op_args(args, scale=None, causal=True, window=(-1, -1), softcap=0.0):
    """The op's schema arguments, floats as a layer passes them (constants)."""
    scale = args[0].shape[-1] ** -0.5 if scale is None else scale
    return (*args, None, scale, causal, *window, softcap, None, None)


@pytest.mark.parametrize("block_size", sorted(flash_backend.PAGED_BLOCK_SIZES))
@pytest.mark.parametrize("options", [dict(), dict(window=(64, 0), softcap=10.0), dict(causal=False),
                                     dict(causal=False, window=(40, 8))])
def test_paged_prefill_through_flash_equals_reference_and_our_kernel(block_size, options):
    args, pad_rows = paged_batch(block_size=block_size)
    full = op_args(args, **options)
    assert flash_backend.covers_paged(*full)
    got = flash_backend.paged_attention(*full)
    # the op's CUDA kernel is flash_backend.paged_attention (ops/backends.py): the same bits
    assert torch.equal(torch.ops.compiled_attn.paged_attention.default(*full), got)
    causal, window, softcap = options.get("causal", True), options.get("window", (-1, -1)), options.get("softcap", 0.0)
    assert_close_to_oracle(got, oracle_paged(*args, None, causal, window, softcap))
    assert bool((got[pad_rows] == 0).all())  # a row that sees no key: zeros
    ours = triton_kernels.paged_attention(*full)
    torch.testing.assert_close(got, ours, atol=2e-2, rtol=2e-2)


def test_paged_decode_and_uncovered_calls_stay_on_our_kernel():
    cases = {"decode": (paged_batch(DECODE)[0], None),
             "block size 128 (TMA pages)": (paged_batch(block_size=128)[0], None),
             "differential": (paged_batch()[0], torch.rand(8, device="cuda"))}
    for name, (args, lam) in cases.items():
        full = list(op_args(args))
        full[6] = lam
        assert not flash_backend.covers_paged(*full), name
        assert torch.equal(torch.ops.compiled_attn.paged_attention.default(*full),
                           triton_kernels.paged_attention(*full)), name


def test_paged_prefill_through_flash_stays_opaque_under_compile():
    args, _ = paged_batch()
    full = op_args(args)
    eager = flash_backend.paged_attention(*full)
    op = torch.ops.compiled_attn.paged_attention.default
    compiled = torch.compile(lambda q: op(q, *full[1:]) * 1.0, fullgraph=True)
    torch.testing.assert_close(compiled(args[0]), eager, atol=0, rtol=0)  # flash-attn 4 ran, not our kernel


def test_paged_prefill_through_flash_captures_in_a_cuda_graph():
    args, _ = paged_batch()
    query = args[0]
    full = op_args(args)
    op = torch.ops.compiled_attn.paged_attention.default
    eager = op(*full)  # compiles flash-attn 4's kernel before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*full)
    query.copy_(torch.randn_like(query))
    graph.replay()
    torch.testing.assert_close(out, flash_backend.paged_attention(*full), atol=0, rtol=0)
    assert not torch.equal(out, eager)
