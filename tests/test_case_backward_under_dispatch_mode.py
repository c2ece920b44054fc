"""Case ``shared/cases/backward-under-dispatch-mode.md``: backward through our ops under a
``TorchDispatchMode`` (``FlopCounterMode``, debug modes) completes, its gradients equal those
computed without the mode (and the float64 oracle's), ``opcheck`` passes on the backward op,
and ``FlopCounterMode`` counts our attention ops as it counts SDPA.

The whole kind: every backward of ours (``varlen_attention``, plain and differential, and
``fused_linear``) is written as explicit tensor ops (``ops/gradients.py``), with no
``torch.func`` transform inside an op kernel.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import compiled_attn.ops as ops
from oracle import oracle_varlen


class Recorder(TorchDispatchMode):
    """A debug mode: records every op it sees and runs it unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _grads(mode, lambda_full=None):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, 16, generator=g).requires_grad_() for _ in range(3))
    leaves = [q, k, v] + ([lambda_full.clone().requires_grad_()] if lambda_full is not None else [])
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with mode:
        ops.varlen_attention(q, k, v, cu, cu, *leaves[3:]).sum().backward()
    return (q, k, v, cu), [t.grad for t in leaves]


def test_backward_under_dispatch_mode():
    """The reported script, then its right values."""
    counter = FlopCounterMode(display=False)
    (q, k, v, cu), got = _grads(counter)
    _, plain = _grads(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    for a, b in zip(got, plain):
        assert torch.equal(a, b)
    # float64 oracle gradients by autograd through the oracle's own arithmetic
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    from torch.overrides import TorchFunctionMode

    class KeepGraph(TorchFunctionMode):  # the oracle detaches its inputs; keep them attached
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.detach:
                return args[0]
            return func(*args, **(kwargs or {}))

    with KeepGraph():
        oracle_varlen(q64, k64, v64, cu, cu).sum().backward()
    for a, b in zip(got, (q64.grad, k64.grad, v64.grad)):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)
    # FLOPs as torch counts SDPA (one sequence of 4 queries and 4 keys, 2 heads of 16)
    counts = counter.get_flop_counts()["Global"]
    assert counts[torch.ops.compiled_attn.varlen_attention] == sdpa_flop_count((1, 2, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16))
    assert counts[torch.ops.compiled_attn.varlen_attention_backward] == sdpa_backward_flop_count(
        (1, 2, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16), (1, 2, 4, 16))


def test_differential_backward_under_a_debug_mode():
    mode = Recorder()
    _, got = _grads(mode, torch.tensor(0.4))
    _, expected = _grads(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), torch.tensor(0.4))
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert "compiled_attn.varlen_attention_backward.default" in mode.seen


def test_backward_op_opcheck():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 4, 16, generator=g) for _ in range(3))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    for lam in (None, torch.tensor([0.3, 0.5])):
        out = ops.varlen_attention(q, k, v, cu, cu, lam)
        grad_out = torch.randn(out.shape, generator=g)
        args = (grad_out, q, k, v, cu, cu, lam, 0.25, True, -1, -1, 0.0, None, None)
        torch.library.opcheck(torch.ops.compiled_attn.varlen_attention_backward.default, args)


def test_fused_linear_backward_under_flop_counter():
    """The same kind of fault in ``fused_linear``'s backward: fixed and counted."""
    g = torch.Generator().manual_seed(2)
    x, weight = torch.randn(3, 8, generator=g), torch.randn(12, 8, generator=g)
    norm_weight, residual = torch.randn(8, generator=g), torch.randn(3, 6, generator=g)

    def run(mode):
        leaves = [t.clone().requires_grad_() for t in (x, weight, norm_weight, residual)]
        with mode:
            ops.fused_linear(leaves[0], leaves[1], norm_weight=leaves[2], residual=leaves[3],
                             silu_and_mul=True).sum().backward()
        return [t.grad for t in leaves]

    counter = FlopCounterMode(display=False)
    got = run(counter)
    expected = run(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert counter.get_flop_counts()["Global"][torch.ops.compiled_attn.fused_linear] == 2 * 3 * 8 * 12
