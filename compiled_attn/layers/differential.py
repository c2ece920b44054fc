"""Differential attention (Ye et al., "Differential Transformer", arXiv 2410.05258).

Section 2.1: ``DiffAttn(X) = (softmax(Q1 K1^T / sqrt(d)) - lambda softmax(Q2 K2^T /
sqrt(d))) V`` with the re-parameterized ``lambda = exp(lambda_q1 . lambda_k1) -
exp(lambda_q2 . lambda_k2) + lambda_init`` and ``lambda_init = 0.8 - 0.6 exp(-0.3 *
depth)``; section 2.2: each head's output goes through ``subln`` (RMSNorm over ``2D``)
and is scaled by ``1 - lambda_init``. Heads are stored as interleaved pairs (query heads
``2j, 2j + 1`` and KV heads ``2g, 2g + 1`` are the two components), so one fused op
reads each K/V block once. ``lambda`` is recomputed from the parameters in every
forward, inside the traced graph.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..metadata import AttentionMetadata
from ..ops.validation import check_heads
from .attention import Attention, KVCacheLayer
from .linear import row_parallel_linear
from .norm import RMSNorm


def lambda_init_for_depth(depth: int) -> float:
    """``0.8 - 0.6 * exp(-0.3 * depth)``, depth = 0-based layer index (paper eq. 2)."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


class DifferentialAttention(Attention):
    """Differential attention layer; input and output ``[T, hidden_size]``.

    Args:
        hidden_size, num_heads, num_kv_heads, head_size: as :class:`Attention`;
            ``num_heads`` counts single heads (``num_heads // 2`` pairs), both counts even.
        depth: 0-based layer index, sets ``lambda_init`` unless given.
        lambda_init: override of the depth schedule.
        lambda_std: standard deviation of the initial ``lambda_q1/k1/q2/k2``.
        subln_affine: ``subln`` has a learned weight (official code) or not (DiffLlama).
        norm_eps: ``subln`` epsilon.
        **kwargs: the remaining :class:`Attention` options (RoPE, window, softcap, ALiBi,
            KV sharing, bias).

    Raises:
        ValueError: odd head counts, and all :class:`Attention` errors.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_size: int | None = None, *,
        depth: int = 0, lambda_init: float | None = None, lambda_std: float = 0.1,
        subln_affine: bool = False, norm_eps: float = 1e-5, **kwargs,
    ) -> None:
        check_heads(num_heads, num_kv_heads, differential=True)
        super().__init__(hidden_size, num_heads, num_kv_heads, head_size, **kwargs)
        self.lambda_init = lambda_init_for_depth(depth) if lambda_init is None else lambda_init
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.randn(self.head_size) * lambda_std))
        self.subln = nn.RMSNorm(2 * self.head_size, eps=norm_eps, elementwise_affine=subln_affine)

    def lambda_full(self) -> torch.Tensor:
        """The 0-d float32 ``lambda`` of this layer, from its parameters."""
        lambda_1 = torch.exp(torch.sum(self.lambda_q1.float() * self.lambda_k1.float()))
        lambda_2 = torch.exp(torch.sum(self.lambda_q2.float() * self.lambda_k2.float()))
        return lambda_1 - lambda_2 + self.lambda_init

    def forward(self, hidden: torch.Tensor, md: AttentionMetadata, kv_cache: KVCacheLayer | None = None,
                input_norm: RMSNorm | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`Attention.forward`."""
        q, k, v = self.project(hidden, md.positions, input_norm)
        pairs = self.attend(q, k, v, md, kv_cache, self.lambda_full())  # [T, H/2, 2D]
        pairs = self.subln(pairs) * (1 - self.lambda_init)
        return row_parallel_linear(pairs.flatten(1), self.o_proj, residual, self.tp)
