"""Rotary position embedding (Su et al., RoFormer, arXiv 2104.09864, section 3.4).

The "rotate half" (GPT-NeoX / Hugging Face Llama) form: for a head vector ``x`` of size
``D`` and frequency ``theta_i = base ** (-2i / D)``, ``x * cos + rotate_half(x) * sin``
with ``cos``/``sin`` of ``position * theta`` repeated over both halves.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Applies RoPE to packed query and key heads.

    Args:
        head_size: ``D``, even.
        base: ``rope_theta``.

    Raises:
        ValueError: odd ``head_size``.
    """

    def __init__(self, head_size: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_size % 2:
            raise ValueError(f"head_size must be even for RoPE, got {head_size}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, *heads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each ``[T, H, D]`` tensor in ``heads`` by ``positions`` (``[T]`` int64).

        Angles are computed in float32 and the result keeps each input's dtype.
        """
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        cos, sin = angles.cos(), angles.sin()
        return tuple(_rotate(x, cos.to(x.dtype), sin.to(x.dtype)) for x in heads)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
