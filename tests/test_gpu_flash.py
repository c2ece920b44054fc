"""The flash-attn backend on a GPU with flash-attn 4 installed (``profiling/gpu_suite.sh flash``).

Our varlen op with the backend against the float64 reference and against our own Triton
kernel, plain and differential (two flash calls), GQA, windows and softcap; the backend's
choice per call; capture in a CUDA graph. Skipped without CUDA or without ``flash_attn.cute``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)"),
]
pytest.importorskip("flash_attn.cute", reason="needs flash-attn 4 (profiling/gpu_suite.sh flash carries it in)")

from oracle import assert_close_to_oracle, oracle_varlen  # noqa: E402
from paged_batches import randn_nonzero  # noqa: E402

from compiled_attn import ops  # noqa: E402
from compiled_attn.ops import flash_backend, triton_kernels  # noqa: E402


def batch(head_size=128):
    g = torch.Generator().manual_seed(head_size)
    lens = [1, 300, 1000, 77]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = randn_nonzero((sum(lens), 16, head_size), torch.bfloat16, g).cuda()
    k, v = (randn_nonzero((sum(lens), 4, head_size), torch.bfloat16, g).cuda() for _ in range(2))
    return q, k, v, cu


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("options", [dict(), dict(window_size=(64, 0), softcap=10.0), dict(causal=False)])
def test_op_through_flash_equals_reference_and_our_kernel(differential, options, monkeypatch):
    q, k, v, cu = batch()
    lam = torch.rand(8, device="cuda") if differential else None
    if differential:  # measured slower than our fused kernel, so off by default: check it anyway
        monkeypatch.setattr(flash_backend, "FLASH_DIFFERENTIAL", True)
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
