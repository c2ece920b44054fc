"""An ``nn.Linear`` applied through :func:`compiled_attn.ops.fused_linear`, with the
RMSNorm before it and the residual add or SwiGLU after it fused in."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import fused_linear
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

    Raises:
        TypeError, ValueError: as :func:`compiled_attn.ops.fused_linear`.
    """
    return fused_linear(x, layer.weight, layer.bias,
                        norm_weight=None if norm is None else norm.weight,
                        norm_eps=1e-6 if norm is None else norm.eps,
                        residual=residual, silu_and_mul=silu_and_mul)
