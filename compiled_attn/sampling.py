"""Token sampling: greedy, temperature and nucleus (top-p, Holtzman et al., arXiv 1904.09751).

Randomness is *counter-based*: the Exp(1) noise of token ``v`` for a row is a hash of
(the request's ``seed``, the ``position`` being sampled, ``v``) (MurmurHash3's 32-bit
finalizer on int64 tensors, no overflow). So a request's tokens depend only on its own
seed and logits, not on the batch it shares, the padding of a captured CUDA graph, or
whether the step ran eagerly, compiled or replayed; and there is no generator state to
register with a graph. Parameters are per-row tensors and there is no data-dependent
control flow, so the function runs the same eagerly, compiled and inside a captured graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


def check_seed(seed: int) -> None:
    """A request seed is an int64 the noise hash takes: ``0 <= seed < 2**63``.

    Raises:
        TypeError: ``seed`` not an int (a float, a bool).
        ValueError: ``seed`` outside that range.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not 0 <= seed < 1 << 63:
        raise ValueError(f"seed must lie in [0, 2**63), got {seed}")


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` (``>= 1``) of a request seeded ``seed`` (``n > 1``):
    the SplitMix64 finalizer (Steele et al., "Fast splittable pseudorandom number
    generators", OOPSLA 2014) of ``seed + index * golden ratio``, kept to 63 bits. Unlike
    the linear ``seed * 1_000_003 + index`` of :meth:`Engine.generate`'s per-prompt seeds,
    it does not map sample ``k`` of prompt 0 onto prompt ``k``'s seed."""
    z = (seed + index * 0x9E3779B97F4A7C15) & (1 << 64) - 1
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & (1 << 64) - 1
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & (1 << 64) - 1
    return (z ^ (z >> 31)) >> 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: keep the smallest set of most likely tokens whose probability reaches
            ``top_p`` (1.0 keeps all).
        max_new_tokens: stop after this many generated tokens.
        seed: the request's random seed; ``None`` lets the engine derive one from its
            own seed and the request's index.
        n: completions of the prompt (parallel sampling, vLLM's ``n``): the prompt is
            computed once and its blocks are shared, sample ``i > 0`` drawing with seed
            :func:`sample_seed` ``(seed, i)``.

    Raises:
        TypeError: ``temperature`` or ``top_p`` not a real number; ``max_new_tokens``,
            ``n`` or ``seed`` not an int.
        ValueError: negative or infinite temperature, ``top_p`` outside ``(0, 1]``,
            ``max_new_tokens < 1``, ``n < 1``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a real number, got {value!r}")
        if not 0 <= self.temperature < math.inf:  # also NaN
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise TypeError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.n, bool) or not isinstance(self.n, int):
            raise TypeError(f"n must be an int, got {self.n!r}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1 (completions per prompt), got {self.n}")
        if self.seed is not None:
            check_seed(self.seed)
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``0 <= x, c < 2**32`` in int64, never overflowing."""
    low = (x & 0xFFFF) * c
    high = ((x >> 16) * c) & 0xFFFF
    return (low + (high << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finalizer: a bijection of 32-bit values with full avalanche."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, vocab_size]`` float32 Exp(1) draws keyed by ``(seeds[b], positions[b], v)``.

    Args:
        seeds, positions: ``[B]`` int64 (any values; reduced mod ``2**32``).
    """
    row = _fmix32(_fmix32(seeds & _MASK32) ^ (positions & _MASK32))
    column = _mul32(torch.arange(vocab_size, device=seeds.device), 0x9E3779B1)
    bits = _fmix32(_fmix32(row.unsqueeze(1) ^ column))
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(uniform)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[B, vocab]`` float32.
        temperature: ``[B]`` float32; rows with 0 take the argmax.
        top_p: ``[B]`` float32 in ``(0, 1]``.
        seeds: ``[B]`` int64 per-request seeds.
        positions: ``[B]`` int64 position of the token being sampled (a fresh draw per
            step of a request).

    Returns:
        ``[B]`` int64 token ids. Sampling uses the exponential-race form of
        ``multinomial``: ``argmax(p / E)`` with ``E ~ Exp(1)``.
    """
    greedy = logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature.clamp_min(1e-6).unsqueeze(1), dim=-1)
    # Drop a token when the more likely tokens already reach top_p (the most likely one
    # always stays; top_p = 1 keeps all even where a float32 cumsum rounds to 1 early).
    sorted_probs = probs.sort(dim=-1, descending=True).values
    cumulative = sorted_probs.cumsum(dim=-1) - sorted_probs
    cutoff = torch.where(cumulative < top_p.unsqueeze(1), sorted_probs, 2.0).amin(dim=-1, keepdim=True)
    keep = (probs >= cutoff) | (top_p.unsqueeze(1) >= 1)
    noise = exponential_noise(seeds, positions, logits.shape[-1])
    sampled = torch.where(keep, probs / noise, -1.0).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)
