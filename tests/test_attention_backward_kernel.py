"""The Triton backward of ``varlen_attention`` (``ops/triton_kernels/attention_backward_kernel.py``),
called directly, against float64 autograd of the reference forward (``ops/reference.py``).

Without a GPU the kernels run on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``,
set by ``conftest.py`` before Triton is imported), at tiny shapes; most cases force 16-wide
tiles so that short sequences still span several query and key tiles (masked edge tiles and
unmasked interior tiles). Every case draws fresh random inputs and upstream gradients (never
zeros) and fills the ``dq``/``dk``/``dv`` buffers with NaN first, so every element must be
written. bfloat16 runs only on a GPU (see ``test_triton_interpret.py``).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed: these tests exercise Triton kernels")

from oracle import assert_close_to_oracle  # noqa: E402
from paged_batches import alibi_slopes, make_lambda, make_varlen_batch, randn_nonzero  # noqa: E402

from compiled_attn.ops import reference  # noqa: E402
from compiled_attn.ops.triton_kernels import attention_backward_kernel as backward  # noqa: E402
from compiled_attn.ops.triton_kernels.attention_backward_kernel import BackwardTiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it unless the "
                "environment overrides it)", allow_module_level=True)
if DEVICE == "cpu" and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    pytest.skip(f"Triton {triton.__version__}'s interpreter cannot use loaded scalars as loop bounds",
                allow_module_level=True)

SMALL = BackwardTiles(dq_rows=16, dq_keys=16, dkdv_keys=16, dkdv_rows=16)


def oracle_gradients(q, k, v, cu_q, cu_k, grad_out, lam, scale, causal, window, softcap, slopes):
    """``(dq, dk, dv, dlambda)`` by float64 autograd of :func:`reference.varlen_attention`."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    lam64 = None if lam is None else lam.detach().cpu().double().requires_grad_()
    out = reference.varlen_attention(*leaves, cu_q.cpu(), cu_k.cpu(), lam64, scale, causal, window[0], window[1],
                                     softcap, None if slopes is None else slopes.cpu().double())
    (out * grad_out.cpu().double()).sum().backward()
    return (*(t.grad for t in leaves), None if lam is None else lam64.grad)


def check(q_lens, k_lens=None, num_heads=4, num_kv_heads=2, head_size=16, dtype=torch.float32, lam=None,
          causal=True, window=(-1, -1), softcap=0.0, slopes=None, tensor_scalars=False, tiles=SMALL,
          extra_q=0, extra_k=0, seed=0):
    """Kernel vs oracle on a fresh batch; ``extra_q``/``extra_k`` tokens past the batch's
    last sequence (buffers longer than ``cu_seqlens[-1]``) must get exact zero gradients."""
    batch = make_varlen_batch(q_lens, k_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                              head_size=head_size, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    q = torch.cat([batch.q, randn_nonzero((extra_q, num_heads, head_size), dtype, g)])
    k = torch.cat([batch.k, randn_nonzero((extra_k, num_kv_heads, head_size), dtype, g)])
    v = torch.cat([batch.v, randn_nonzero((extra_k, num_kv_heads, head_size), dtype, g)])
    out_shape = (q.shape[0], num_heads // 2, 2 * head_size) if lam is not None else tuple(q.shape)
    grad_out = randn_nonzero(out_shape, dtype, g)
    scale = 0.7 * head_size ** -0.5
    dev = [t.to(DEVICE) for t in (grad_out, q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_k)]
    lam_dev = None if lam is None else lam.to(DEVICE)
    slopes_dev = None if slopes is None else slopes.to(DEVICE)
    bufs = tuple(torch.full_like(t, float("nan")) for t in dev[1:4])
    call_scale, call_softcap, scalars = scale, softcap, None
    if tensor_scalars:  # the floats must then be ignored
        call_scale, call_softcap = 123.0, 0.0
        scalars = torch.tensor([scale, softcap], dtype=torch.float32, device=DEVICE)
    got = backward.varlen_attention_backward(*dev, lam_dev, call_scale, causal, window[0], window[1], call_softcap,
                                             slopes_dev, scalars, out=bufs, tiles=tiles)
    assert all(a is b for a, b in zip(got[:3], bufs))
    expected = oracle_gradients(batch.q, batch.k, batch.v, batch.cu_seqlens_q, batch.cu_seqlens_k,
                                grad_out[: batch.q.shape[0]], lam, scale, causal, window, softcap, slopes)
    tq, tk = batch.q.shape[0], batch.k.shape[0]
    for name, ours, ref, n in zip(("dq", "dk", "dv"), got[:3], expected[:3], (tq, tk, tk)):
        assert_close_to_oracle(ours[:n], ref, dtype=dtype, what=name)
        assert bool((ours[n:] == 0).all()), f"{name}: tokens past cu_seqlens[-1] must get zeros"
    if lam is None:
        assert got[3].shape == (0,)
    else:
        assert got[3].shape == lam.shape and got[3].dtype == lam.dtype
        assert_close_to_oracle(got[3].to(dtype), expected[3], what="dlambda")  # at the inputs' tolerance
    return got


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plain_causal_lengths(dtype):
    """A sequence of length 1, one longer than a block (several query and key tiles, interior
    tiles included), partial last blocks; GQA 1."""
    check([1, 37, 20], num_heads=2, num_kv_heads=2, dtype=dtype)


def test_unequal_lengths_bottom_right():
    """Causal bottom-right alignment with more keys than queries, more queries than keys
    (rows that see no key), a sequence with no key and one with no query; GQA 2, D 32."""
    check([5, 17, 3, 6, 4, 0], [12, 17, 30, 2, 0, 5], num_heads=4, num_kv_heads=2, head_size=32, seed=1)


@pytest.mark.parametrize("causal, window", [(True, (7, -1)), (False, (4, 2)), (False, (-1, 0)), (False, (-1, -1))],
                         ids=["causal-left7", "window-4-2", "right0", "full"])
def test_windows_gqa4_head72(causal, window):
    """Sliding windows (key tiles skipped on both sides), GQA 4, head size 72 (padded to 128)."""
    check([21, 3], [26, 3], num_heads=8, num_kv_heads=2, head_size=72, causal=causal, window=window, seed=2)


@pytest.mark.parametrize(
    "num_heads, causal, window",
    [(8, True, (20, -1)), (8, False, (17, 6)), (8, False, (2, 19)), (2, True, (33, -1)), (2, False, (9, 40))],
    ids=["gqa8-causal-left20", "gqa8-window-17-6", "gqa8-window-2-19", "causal-left33", "window-9-40"])
def test_window_edges(num_heads, causal, window):
    """Windows wider than a tile, so that key and query tiles are whole (unmasked) inside the
    window and masked at both of its edges, at many alignments: GQA 8 (2 query tokens per
    tile) and GQA 1 (16), more keys than queries and the reverse."""
    check([45, 30, 7], [52, 30, 3], num_heads=num_heads, num_kv_heads=1, head_size=16, causal=causal,
          window=window, seed=11)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(6, 2), (8, 1)], ids=["gqa3", "gqa8"])
def test_gqa_groups(num_heads, num_kv_heads):
    """A group that is not a power of two (padded member rows) and GQA 8."""
    check([18, 1, 9], num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=16, seed=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("per_pair", [False, True], ids=["scalar", "per-pair"])
def test_differential(per_pair, dtype):
    """Differential attention, 0-d and per-pair lambda (dlambda reduced to its shape), GQA 1."""
    check([1, 37, 11], num_heads=4, num_kv_heads=4, head_size=16, dtype=dtype,
          lam=make_lambda(4, per_pair, seed=4), seed=4)


@pytest.mark.parametrize("num_kv_heads, head_size, window",
                         [(4, 32, (5, -1)), (2, 24, (-1, -1)), (2, 72, (3, -1))],
                         ids=["gqa2-d32-window", "gqa4-d24", "gqa4-d72-window"])
def test_differential_gqa(num_kv_heads, head_size, window):
    check([20, 9, 1], [25, 9, 4], num_heads=8, num_kv_heads=num_kv_heads, head_size=head_size,
          lam=make_lambda(8, per_pair=True, seed=5), window=window, seed=5)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_softcap_alibi(differential):
    """Softcap (its tanh chain rule) and ALiBi (constant, no gradient), cross-attention."""
    lam = make_lambda(4, per_pair=True, seed=6) if differential else None
    check([9, 19], [23, 5], num_heads=4, num_kv_heads=2 if not differential else 4, head_size=16, lam=lam,
          causal=False, softcap=2.0, slopes=alibi_slopes(4), seed=6)


@pytest.mark.parametrize("softcap", [0.0, 3.0], ids=["no-cap", "cap"])
def test_runtime_scalars(softcap):
    """``scale_softcap`` (what compiled code passes): the tensor's values replace the floats,
    and a softcap of 0 in it turns capping off."""
    check([13, 6], num_heads=4, num_kv_heads=2, head_size=16, softcap=softcap, tensor_scalars=True, seed=7)
    check([13, 6], num_heads=4, num_kv_heads=4, head_size=16, softcap=softcap, tensor_scalars=True,
          lam=make_lambda(4, per_pair=False, seed=7), seed=7)


def test_tokens_past_the_batch_get_zeros():
    """q/k buffers longer than ``cu_seqlens[-1]``: zero gradients there, written by the
    extra tail tile (the buffers start as NaN)."""
    check([4, 18], num_heads=4, num_kv_heads=2, head_size=16, extra_q=21, extra_k=5, seed=8)
    check([4, 18], num_heads=4, num_kv_heads=4, head_size=16, extra_q=3, extra_k=19,
          lam=make_lambda(4, per_pair=True, seed=8), seed=8)


@pytest.mark.parametrize("differential", [False, True], ids=["plain", "differential"])
def test_default_tiles(differential):
    """The tiles the launcher picks from shapes (the ones the GPU runs)."""
    lam = make_lambda(4, per_pair=False, seed=9) if differential else None
    check([3, 40, 1], num_heads=4, num_kv_heads=4 if differential else 1, head_size=32, lam=lam, tiles=None,
          seed=9)


def test_empty_batch_gives_zeros():
    q = torch.randn(0, 4, 16, device=DEVICE)
    k = torch.randn(5, 4, 16, device=DEVICE)
    cu_q = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 5], dtype=torch.int32, device=DEVICE)
    lam = torch.tensor(0.5, device=DEVICE)
    dq, dk, dv, dlam = backward.varlen_attention_backward(q.new_empty(0, 2, 32), q, k, k, cu_q, cu_k, lam, 0.25)
    assert dq.shape == q.shape and bool((dk == 0).all()) and bool((dv == 0).all()) and dlam.shape == ()
    assert float(dlam) == 0.0


def test_uncovered_dtype_runs_the_reference():
    """float64 (only reachable by calling the backward op directly) falls back to the reference."""
    batch = make_varlen_batch([5, 3], num_heads=2, num_kv_heads=2, head_size=8, dtype=torch.float64, seed=10)
    args = [t.to(DEVICE) for t in (batch.q, batch.k, batch.v, batch.cu_seqlens_q, batch.cu_seqlens_k)]
    assert not backward.covers(args[0], *args, None, 0.3, True, -1, -1, 0.0, None, None)
    grad_out = torch.randn(batch.q.shape, dtype=torch.float64, device=DEVICE)
    got = backward.varlen_attention_backward(grad_out, *args, None, 0.3, True, -1, -1, 0.0, None, None)
    expected = oracle_gradients(*args, grad_out, None, 0.3, True, (-1, -1), 0.0, None)
    for ours, ref in zip(got[:3], expected[:3]):
        torch.testing.assert_close(ours.cpu(), ref)


def test_registered_as_the_cuda_kernel():
    """``compiled_attn::varlen_attention_backward`` has our launcher as its CUDA kernel."""
    import compiled_attn.ops  # noqa: F401  (registers the kernels)

    assert torch._C._dispatch_has_kernel_for_dispatch_key("compiled_attn::varlen_attention_backward", "CUDA")


def test_kernels_compile_for_sm90():
    """The kernels type-check and lower to a cubin for sm90 (H100/H200) at their default tiles,
    within its 227 KiB of shared memory per block (``tests/compile_sm90.py``, in a process
    without ``TRITON_INTERPRET``; no GPU needed)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_sm90.py")
    done = subprocess.run([sys.executable, str(script), "backward"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 6 and {r["kernel"] for r in report} == {"attention_backward_dq_kernel",
                                                                  "attention_backward_dkdv_kernel"}
    assert all(0 < r["shared"] <= 227 * 1024 for r in report), report
