"""Our Triton kernels inside Inductor's code: ``torch.compile`` traces the launchers of the
attention ops and ``fused_linear`` (static CUDA shapes) and launches the kernels itself.

Run on the H200 with ``pytest -m gpu``. Each compiled call is compared with the eager call of
the same op on the same inputs (the same kernels with the same tiles: equal within a last
bit of bf16 rounding) and with the float64 reference; the generated code must hold our
kernels and no call of the op, or, with a dynamic batch, the op itself.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (run on the H200: profiling/gpu_suite.sh)"),
]
pytest.importorskip("triton", reason="Triton is not installed: these tests exercise Triton kernels")

import torch._functorch.config  # noqa: E402
import torch._inductor.config  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

from oracle import assert_close_to_oracle  # noqa: E402
from paged_batches import make_lambda, make_paged_batch, pad, randn_nonzero  # noqa: E402

import compiled_attn.ops as ops  # noqa: E402
from compiled_attn.ops import reference  # noqa: E402

OP_CALL = "torch.ops.compiled_attn"


def compiled_code(fn, *args):
    """``(result, generated source)`` of ``torch.compile(fn, fullgraph=True)(*args)``, with
    the compile caches off: their keys hold the graph of op calls, not the routing flags
    the tests patch (``PREFILL_HEAD_SIZES``, ``GLUON_PREFILL``), so a graph compiled under
    other flags (another parametrization with the same shapes, another worker through the
    on-disk cache) would come back with its kernels (on the H200, 2026-12-02, with the caches
    on, the ``prefill_kernel-64`` case, run after the ``attention_kernel-64`` case in the same
    process, found no ``prefill_kernel`` in its code; with them off it passed)."""
    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        result, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return result, "\n".join(code)


def paged_args(seqs, seed):
    batch = make_paged_batch(seqs, num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                             seed=seed, unused_fill="nan")
    return [t.cuda() for t in batch.attention_args()], batch.pad_rows


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
@pytest.mark.parametrize("seqs", [[(1000, 1)], [(0, 70), (33, 5), (500, 1), pad(1)]], ids=["decode-split", "mixed"])
def test_compiled_paged_attention_launches_our_kernels(seqs, differential):
    args, pad_rows = paged_args(seqs, seed=len(seqs))
    lam = make_lambda(8, per_pair=True).cuda() if differential else None
    expected = ops.paged_attention(*args, lam)
    got, code = compiled_code(lambda *a: ops.paged_attention(*a, lam) * 1.0, *args)
    assert "attention_kernel" in code and OP_CALL not in code
    if seqs == [(1000, 1)]:
        assert "merge_splits_kernel" in code  # one decode row over 1000 keys splits the keys
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=0)
    query, key_cache, value_cache, cu, seq_lens, table = args
    assert_close_to_oracle(got, reference.paged_attention(
        query.double(), key_cache.double(), value_cache.double(), cu, seq_lens, table, lam, 64 ** -0.5,
        True, -1, -1, 0.0, None))
    assert bool((got[pad_rows] == 0).all())


@pytest.mark.parametrize("kernel, head_size", [("attention_kernel", 64), ("prefill_kernel", 64),
                                               ("prefill_kernel", 128)])
def test_compiled_varlen_attention_launches_our_kernels_and_trains(kernel, head_size, monkeypatch):
    """Forward traced through the launcher (the unified kernel, or the Hopper prefill kernel
    that ``PREFILL_KERNEL`` routes covered head sizes to: at D 128 its sequential
    differential schedule, which reads its own output back), backward through the op's
    gradient formula. (The Gluon kernel, which takes these calls first on an sm90 GPU and
    stays an opaque op call, switched off: ``GLUON_PREFILL``; its compiled calls are
    ``test_gluon_prefill_kernel.py``'s.)"""
    from compiled_attn.ops.triton_kernels import attention

    routed = frozenset({head_size} if kernel == "prefill_kernel" else ())
    monkeypatch.setattr(attention, "PREFILL_HEAD_SIZES", routed)
    monkeypatch.setattr(attention, "GLUON_PREFILL", False)
    g = torch.Generator().manual_seed(3)
    lens = [1, 70, 129]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (randn_nonzero((sum(lens), h, head_size), torch.bfloat16, g).cuda().requires_grad_()
               for h in (8, 2, 2))
    lam = make_lambda(8, per_pair=True).cuda()

    def loss(q, k, v):
        return ops.varlen_attention(q, k, v, cu, cu, lam).float().square().sum()

    expected_loss = loss(q, k, v)
    expected = torch.autograd.grad(expected_loss, (q, k, v))
    got_loss, code = compiled_code(loss, q, k, v)
    assert kernel in code and f"{OP_CALL}.varlen_attention.default" not in code
    torch.testing.assert_close(got_loss, expected_loss, rtol=1e-3, atol=0)
    for a, b in zip(torch.autograd.grad(got_loss, (q, k, v)), expected):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("silu_and_mul", [False, True])
def test_compiled_fused_linear_launches_our_kernels(rows, silu_and_mul):
    g = torch.Generator().manual_seed(rows)
    x = randn_nonzero((rows, 512), torch.bfloat16, g).cuda()
    weight = (randn_nonzero((768, 512), torch.bfloat16, g) * 0.05).cuda()
    norm_weight = randn_nonzero((512,), torch.bfloat16, g).cuda()
    residual = randn_nonzero((rows, 384 if silu_and_mul else 768), torch.bfloat16, g).cuda()

    def f(x):
        return ops.fused_linear(x, weight, norm_weight=norm_weight, residual=residual, silu_and_mul=silu_and_mul)

    got, code = compiled_code(f, x)
    assert OP_CALL not in code
    if rows == 1:
        assert "fused_linear_kernel" in code
    torch.testing.assert_close(got, f(x), atol=3e-2, rtol=2e-2)
    exact = reference.fused_linear(x.double(), weight.double(), None, norm_weight.double(), 1e-6,
                                   residual.double(), silu_and_mul)
    torch.testing.assert_close(got.double(), exact, atol=8e-2, rtol=3e-2)


def test_dynamic_batch_keeps_the_op_opaque():
    """Symbolic shapes: the launcher picks its plan per call from the real shapes."""
    args, _ = paged_args([(100, 1), (7, 1), (300, 1)], seed=9)
    torch._dynamo.mark_dynamic(args[0], 0)
    got, code = compiled_code(lambda *a: ops.paged_attention(*a) * 1.0, *args)
    assert f"{OP_CALL}.paged_attention" in code
    torch.testing.assert_close(got, ops.paged_attention(*args), atol=0, rtol=0)


def test_compiled_model_step_in_cuda_graphs_matches_eager():
    """A user's static ``torch.compile(model, mode="reduce-overhead")`` decode over our
    kernels launched by Inductor: tokens equal to eager for 12 steps (float32, so that
    Inductor's own fusions round no differently enough to flip a pick)."""
    from torch._dynamo.utils import counters

    from compiled_attn.kv_cache import allocate_kv_caches
    from compiled_attn.metadata import SequenceChunk, build_metadata
    from compiled_attn.models import DiffLlamaConfig, build_random_model

    config = DiffLlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                             max_position_embeddings=256, eos_token_id=None, lambda_std_dev=0.3)
    model = build_random_model(config, seed=2, dtype=torch.float32, device="cuda")
    model.lm_head.weight.mul_(30.0)  # wide logit margins: greedy picks are not near-ties

    def run(step, batch=3, steps=12):
        caches = allocate_kv_caches(2, 64, 16, 4, 32, torch.float32, "cuda")
        tables = [list(range(b * 8, b * 8 + 8)) for b in range(batch)]
        prompt = [[5 + b, 17, 3 * b] for b in range(batch)]
        tokens = model(build_metadata([SequenceChunk(p, 0, t) for p, t in zip(prompt, tables)], 16, 8, "cuda"),
                       caches).argmax(-1).tolist()
        out = [tokens]
        for i in range(steps):
            md = build_metadata([SequenceChunk([t], 3 + i, tab) for t, tab in zip(tokens, tables)], 16, 8, "cuda")
            tokens = step(md, caches).argmax(-1).tolist()
            out.append(tokens)
        return out

    eager = run(model)
    torch._dynamo.reset()
    skipped = counters["inductor"]["cudagraph_skips"]
    assert run(torch.compile(model, mode="reduce-overhead", fullgraph=True)) == eager
    assert counters["inductor"]["cudagraph_skips"] == skipped  # no input counted as written
