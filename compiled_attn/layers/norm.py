"""RMSNorm (Zhang & Sennrich, arXiv 1910.07467), computed in float32 as Llama does."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim; statistics in float32.

    Matches Hugging Face ``LlamaRMSNorm``/``DiffLlamaRMSNorm``: normalize in float32, cast
    back to the input dtype, then scale by ``weight``.

    Args:
        hidden_size: size of the last dim.
        eps: added to the mean square.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
