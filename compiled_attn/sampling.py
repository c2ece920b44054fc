"""Token sampling: greedy, temperature and nucleus (top-p, Holtzman et al., arXiv 1904.09751).

Per-request parameters are tensors and there is no data-dependent control flow, so the
same function can run eagerly, compiled, or inside a captured graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: keep the smallest set of most likely tokens whose probability reaches
            ``top_p`` (1.0 keeps all).
        max_new_tokens: stop after this many generated tokens.

    Raises:
        ValueError: negative temperature, ``top_p`` outside ``(0, 1]``, ``max_new_tokens < 1``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[B, vocab]`` float32.
        temperature: ``[B]`` float32; rows with 0 take the argmax.
        top_p: ``[B]`` float32 in ``(0, 1]``.
        generator: source of randomness (seeded by the caller for reproducibility).

    Returns:
        ``[B]`` int64 token ids. Sampling uses the exponential-race form of
        ``multinomial``: ``argmax(p / E)`` with ``E ~ Exp(1)``.
    """
    greedy = logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature.clamp_min(1e-6)[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Drop a token when the tokens before it already reach top_p (the first always stays;
    # top_p = 1 keeps every token even where the float32 cumsum rounds up to 1 early).
    outside = (sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    noise = torch.empty_like(sorted_probs).exponential_(generator=generator)
    choice = (sorted_probs / noise).argmax(dim=-1, keepdim=True)
    sampled = order.gather(-1, choice).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)
