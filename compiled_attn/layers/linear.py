"""An ``nn.Linear`` with the RMSNorm before it and the residual add or SwiGLU after it
fused in: the ``compiled_attn::fused_linear`` op on accelerators, its PyTorch composition
on the CPU."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import TensorParallel, all_reduce
from ..ops import reference
from ..ops.linear import FUSED_LINEAR
from .norm import RMSNorm


def linear(x: torch.Tensor, layer: nn.Linear, norm: RMSNorm | None = None,
           residual: torch.Tensor | None = None, silu_and_mul: bool = False) -> torch.Tensor:
    """``residual + act(layer(norm(x)))`` for ``x`` ``[T, in_features]``.

    Args:
        layer: its ``weight`` (and ``bias``) are used; ``x``'s dtype.
        norm: an :class:`RMSNorm` over ``x``'s features applied first, or ``None``.
        residual: ``[T, out]`` added last, or ``None``.
        silu_and_mul: SwiGLU over the two halves of ``layer``'s output (gate, then up).

    Returns:
        ``[T, out]`` (``out = layer.out_features``, halved with ``silu_and_mul``).

    On the CPU the op's reference composition (:func:`compiled_attn.ops.reference.fused_linear`)
    runs inline instead of the op: under ``torch.compile`` Inductor then fuses the norm,
    SwiGLU and residual into the kernels around the GEMM, which an opaque op would hide from
    it (the op's CPU kernel is that same composition, run op by op). The device is fixed
    per compiled graph, so this costs no guard.

    Raises:
        TypeError, ValueError: as :func:`compiled_attn.ops.fused_linear`, from the op's
        fake while tracing; an eager call goes straight to the kernel (the shortest path),
        so shapes are the layer's to get right.
    """
    args = (x, layer.weight, layer.bias, None if norm is None else norm.weight,
            1e-6 if norm is None else norm.eps, residual, silu_and_mul)
    return reference.fused_linear(*args) if x.is_cpu else FUSED_LINEAR(*args)


def row_parallel_linear(x: torch.Tensor, layer: nn.Linear, residual: torch.Tensor | None,
                        tp: TensorParallel | None) -> torch.Tensor:
    """:func:`linear` of a row-parallel (fan-in) projection: ``residual + layer(x)``.

    With ``tp`` (more than one rank), ``layer`` holds this rank's input rows and ``x`` the
    matching features, so the ranks' partial products sum to the full one: one all-reduce
    (Megatron-LM, arXiv 1909.08053 §3; vLLM ``RowParallelLinear``). Rank 0 alone adds
    ``residual`` (and holds the bias, see :func:`compiled_attn.models.sharding.shard_model`),
    so both are counted once. ``tp=None``: plain :func:`linear`.
    """
    if tp is None:
        return linear(x, layer, residual=residual)
    return all_reduce(linear(x, layer, residual=residual if tp.rank == 0 else None), tp)
