"""``fused_linear``: a linear layer with its decode-step neighbours fused in.

``residual + act(rms_norm(x) @ weight.T + bias)``, each part optional, where ``act`` is
nothing or SwiGLU's ``silu(gate) * up`` over the two halves of the output (vLLM
``MergedColumnParallelLinear`` followed by ``SiluAndMul``). One custom op in the
``compiled_attn`` namespace: the reference of :mod:`compiled_attn.ops.reference` on every
device, and on CUDA :func:`compiled_attn.ops.triton_kernels.fused_linear`: one fused
GEMV kernel for a few rows (a decode batch, where the GEMM is a weight read), cuBLAS
between a norm kernel and a SwiGLU kernel for more.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from .validation import FLOAT_DTYPES, check_dtype, check_ndim

@torch.library.custom_op("compiled_attn::fused_linear", mutates_args=())
def fused_linear_op(x: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor | None,
                    norm_eps: float, residual: Tensor | None, silu_and_mul: bool) -> Tensor:
    return reference.fused_linear(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul)


@fused_linear_op.register_fake
def _(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul):
    out_features = check_linear_args(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul)
    return x.new_empty((x.shape[0], out_features))


def check_linear_args(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul) -> int:
    """Shape and dtype checks of :func:`fused_linear`; returns the output width."""
    check_dtype("x", x, FLOAT_DTYPES)
    check_ndim("x", x, 2, "[num_tokens, in_features]")
    check_ndim("weight", weight, 2, "[out_features, in_features]")
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
    if norm_weight is not None:
        if tuple(norm_weight.shape) != (x.shape[1],):
            raise ValueError(f"norm_weight must be [{x.shape[1]}], got {tuple(norm_weight.shape)}")
        if not norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {norm_eps}")
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
    result is ``silu(gate) * up``. Each step rounds to ``x``'s dtype as the unfused
    PyTorch code does; the GEMM accumulates in float32.

    Args:
        x: ``[num_tokens, in_features]`` float16/bfloat16/float32.
        weight: ``[out_features, in_features]`` (``[2 * out, in]`` with ``silu_and_mul``),
            ``x``'s dtype; bias: ``[weight.shape[0]]`` or ``None``.
        norm_weight: ``[in_features]`` RMSNorm weight, or ``None`` for no norm.
        norm_eps: RMSNorm epsilon (> 0).
        residual: ``[num_tokens, out]`` added last, or ``None``.
        silu_and_mul: apply SwiGLU to the two output halves.

    Returns:
        ``[num_tokens, out]`` in ``x``'s dtype (a new tensor).

    Raises:
        TypeError: non-float ``x``, or a tensor whose dtype differs from ``x``'s.
        ValueError: shapes that disagree, an odd row count with ``silu_and_mul``, a tensor on
        another device, ``norm_eps <= 0``.
    """
    if not torch.compiler.is_compiling():
        check_linear_args(x, weight, bias, norm_weight, norm_eps, residual, silu_and_mul)
    return fused_linear_op(x, weight, bias, norm_weight, float(norm_eps), residual, silu_and_mul)
