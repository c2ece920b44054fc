"""``fused_linear``: a linear layer with its decode-step neighbours fused in.

``residual + act(rms_norm(x) @ weight.T + bias)``, each part optional, where ``act`` is
nothing or SwiGLU's ``silu(gate) * up`` over the two halves of the output (vLLM
``MergedColumnParallelLinear`` followed by ``SiluAndMul``). One custom op in the
``compiled_attn`` namespace (:mod:`.library`): the reference of
:mod:`compiled_attn.ops.reference` on every device, and on CUDA
:func:`compiled_attn.ops.triton_kernels.fused_linear`: one fused GEMV kernel for one row (a
batch-1 decode step, where the GEMM is a weight read), cuBLAS between a norm kernel and a
SwiGLU kernel for more (float64 keeps the reference). The op has an autograd formula, the
explicit gradients of :func:`compiled_attn.ops.gradients.fused_linear_backward`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import reference
from .gradients import fused_linear_backward
from .library import LIBRARY, define_op
from .validation import FLOAT_DTYPES, check_dtype, check_ndim


def _fake(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul):
    out_features = check_linear_args(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul)
    return x.new_empty((x.shape[0], out_features))


FUSED_LINEAR = define_op(
    "fused_linear(Tensor x, Tensor weight, Tensor? bias, Tensor? norm_weight, float norm_eps, "
    "Tensor? residual, bool silu_and_mul) -> Tensor",
    reference.fused_linear, _fake)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul = inputs
    ctx.save_for_backward(x, weight, bias, norm_weight, residual)
    ctx.norm_eps, ctx.silu_and_mul = norm_eps, silu_and_mul


def _backward(ctx, grad_out):
    x, weight, bias, norm_weight, residual = ctx.saved_tensors
    dx, dweight, dbias, dnorm_weight, dresidual = fused_linear_backward(
        grad_out, x, weight, bias, norm_weight, ctx.norm_eps, residual, ctx.silu_and_mul, ctx.needs_input_grad)
    return dx, dweight, dbias, dnorm_weight, None, dresidual, None


torch.library.register_autograd(FUSED_LINEAR, _backward, setup_context=_setup_context, lib=LIBRARY)


def check_linear_args(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul) -> int:
    """Shape and dtype checks of :func:`fused_linear`; returns the output width."""
    check_dtype("x", x, (*FLOAT_DTYPES, torch.float64))
    check_dtype("weight", weight, (x.dtype,))
    check_ndim("x", x, 2, "[num_tokens, in_features]")
    check_ndim("weight", weight, 2, "[out_features, in_features]")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)):
        raise TypeError(f"norm_eps must be a float, got {type(norm_eps).__name__}")
    if not 0 < norm_eps < math.inf:
        raise ValueError(f"norm_eps must be finite and > 0, got {norm_eps}")
    tensors = {"weight": weight, "bias": bias, "norm_weight": norm_weight, "residual": residual}
    for name, tensor in tensors.items():
        if tensor is not None:
            check_dtype(name, tensor, (x.dtype,))
            if tensor.device != x.device:
                raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [out_features, {x.shape[1]}] for x {tuple(x.shape)}, "
                         f"got {tuple(weight.shape)}")
    if silu_and_mul and weight.shape[0] % 2:
        raise ValueError(f"silu_and_mul needs an even number of weight rows (gate, up), got {weight.shape[0]}")
    out_features = weight.shape[0] // 2 if silu_and_mul else weight.shape[0]
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if norm_weight is not None and tuple(norm_weight.shape) != (x.shape[1],):
        raise ValueError(f"norm_weight must be [{x.shape[1]}], got {tuple(norm_weight.shape)}")
    if residual is not None and tuple(residual.shape) != (x.shape[0], out_features):
        raise ValueError(f"residual must be [{x.shape[0]}, {out_features}], got {tuple(residual.shape)}")
    return out_features


def fused_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                 norm_weight: Tensor | None = None, norm_eps: float = 1e-6,
                 residual: Tensor | None = None, silu_and_mul: bool = False) -> Tensor:
    """``residual + act(rms_norm(x) @ weight.T + bias)``; parts left ``None`` are skipped.

    ``rms_norm`` is Hugging Face ``LlamaRMSNorm`` (Zhang & Sennrich, arXiv 1910.07467):
    ``norm_weight * (x / sqrt(mean(x^2) + norm_eps))`` with the statistics in float32 and
    the product in ``x``'s dtype. ``silu_and_mul`` is SwiGLU (Shazeer, arXiv 2002.05202):
    the first half of the output columns is the gate, the second the up projection, and the
    result is ``silu(gate) * up``. The GEMM accumulates in float32. The CPU reference
    rounds each step to ``x``'s dtype as the unfused PyTorch code does; the CUDA kernels
    round once less in places (the one-row GEMV keeps the normalized input in float32,
    cuBLAS ``addmm`` adds the residual before rounding), which moves results by about one
    unit in the last place.

    Args:
        x: ``[num_tokens, in_features]`` float16/bfloat16/float32/float64.
        weight: ``[out_features, in_features]`` (``[2 * out, in]`` with ``silu_and_mul``),
            ``x``'s dtype; bias: ``[weight.shape[0]]`` or ``None``.
        norm_weight: ``[in_features]`` RMSNorm weight, or ``None`` for no norm.
        norm_eps: RMSNorm epsilon (finite, > 0; unused without ``norm_weight``).
        residual: ``[num_tokens, out]`` added last, or ``None``.
        silu_and_mul: apply SwiGLU to the two output halves.

    Returns:
        ``[num_tokens, out]`` in ``x``'s dtype, a new contiguous tensor.

    Raises:
        TypeError: a non-tensor or non-float ``x``, a tensor whose dtype differs from
        ``x``'s, a non-number ``norm_eps``.
        ValueError: shapes that disagree, an odd row count with ``silu_and_mul``, a tensor on
        another device, ``norm_eps`` not finite and > 0. (Under ``torch.compile`` the same
        checks run while tracing and surface wrapped in torch's tracing error.)
    """
    if not torch.compiler.is_compiling():
        check_linear_args(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul)
    return FUSED_LINEAR(x, weight, bias, norm_weight, float(norm_eps), residual, silu_and_mul)
