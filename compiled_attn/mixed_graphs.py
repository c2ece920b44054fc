"""Mixed steps (prefill chunks and decode rows) as captured CUDA graphs.

Without a graph, a mixed step runs the compiled model with dynamic shapes, whose custom ops
stay opaque Python calls: about 18 ms of host work a step for the 16-layer 1.1 B model on an
H200, whatever its token count, where the device needs about 1 ms for 64 tokens
(``profiling/results/serving.md``, 2026-11-30). As vLLM V1 does for mixed batches over
graph-safe attention (its ``FULL`` CUDA-graph mode), the step is captured once per padded
shape ``(tokens, seqs)`` and replayed. The attention ops read no tensor values on the host
(their launches depend on shapes only), so one graph serves every batch of its shape:

* **tokens** are padded to the smallest capture size that holds them (16, 24, 32, 48, 64,
  96, ...: powers of two and 1.5 times them, so padding adds at most half, up to the token
  budget, which is a size too, and at most :data:`MAX_CAPTURE_TOKENS`); the pad tokens form one
  padding sequence with no keys (``seq_len`` 0, slots ``PAD_SLOT_ID``), which attends to
  nothing, writes nothing and gives zeros;
* **sequences** are padded to a power of two; the padding sequences after it hold no
  tokens and no keys. The sequence count is part of the shape because the attention
  kernels' tiles follow ``tokens / seqs``
  (:func:`~compiled_attn.ops.triton_kernels.config.choose_tiles`): a long chunk keeps
  prefill-sized tiles;
* **draws** (sampled tokens: one per chunk, plus parallel samples) are padded to the
  sequence count. As for decode steps, each shape has two graphs: one that runs the
  sampler, and one that takes the argmax for a step whose draws are all greedy (vLLM's
  ``all_greedy``: no sort, no noise, and no sampling inputs to write).

A step that fits no captured shape runs the compiled model directly (see
:meth:`~compiled_attn.model_runner.ModelRunner.launch_chunks`).
"""

from __future__ import annotations

from typing import Callable

import torch

from .step_inputs import MixedBuffers

MAX_CAPTURE_TOKENS = 2048
"""Largest token count captured by default: past it a step's device time dwarfs its host time."""

_MIN_CAPTURE_TOKENS = 16


def _powers_of_two(low: int, high: int) -> list[int]:
    return [1 << i for i in range(low.bit_length() - 1, high.bit_length()) if low <= 1 << i <= high]


def _token_sizes(low: int, high: int) -> list[int]:
    """Powers of two from ``low`` (a power of two) and 1.5 times them, up to ``high``, and
    ``high`` itself."""
    sizes = [size for power in _powers_of_two(low, high) for size in (power, power * 3 // 2) if size <= high]
    return sorted(set(sizes + [high]))


def default_mixed_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int | None) -> list[tuple[int, int]]:
    """``(tokens, seqs)`` shapes to capture: tokens 16, 24, 32, 48, ... (powers of two and
    1.5 times them) up to the token budget (or :data:`MAX_CAPTURE_TOKENS`), the budget
    included; seqs a power of two up to the first that holds ``max_num_seqs`` requests and
    a padding sequence, never more seqs than tokens.

    The 1.5 steps halve the worst padding of a power-of-two ladder (a 68-token prefix hit
    ran as 128 tokens: 2.14 ms against 1.56 ms for 64 on the H200, 1.1 B model,
    ``profiling/results/serving.md``) for about twice the graphs (108 shapes against 58 for
    64 sequences; their capture took 3.5-4.5 s at 58)."""
    max_tokens = min(max_num_batched_tokens or MAX_CAPTURE_TOKENS, MAX_CAPTURE_TOKENS)
    max_seqs = 1 << max_num_seqs.bit_length()  # > max_num_seqs: room for the padding sequence
    return [(t, s) for t in _token_sizes(_MIN_CAPTURE_TOKENS, max_tokens)
            for s in _powers_of_two(1, max_seqs) if s <= t]


def check_mixed_capture_sizes(sizes) -> list[tuple[int, int]]:
    """``sizes`` (``Engine(mixed_capture_sizes=...)``) as a list of ``(tokens, seqs)`` int
    pairs with ``1 <= seqs <= tokens``.

    Raises:
        ValueError: any other entry.
    """
    checked = []
    for size in sizes:
        if not (isinstance(size, (tuple, list)) and len(size) == 2
                and all(isinstance(n, int) and not isinstance(n, bool) for n in size) and 1 <= size[1] <= size[0]):
            raise ValueError(f"mixed_capture_sizes must hold (tokens, seqs) int pairs with 1 <= seqs <= tokens, "
                             f"got {size!r}")
        checked.append(tuple(size))
    return checked


def mixed_step(forward: Callable, kv_caches, buffers: MixedBuffers, shape: tuple[int, int],
               sampler: Callable, greedy: bool = False) -> torch.Tensor:
    """Forward the buffers as a ``shape = (tokens, seqs)`` batch and sample every draw row
    (``greedy``: take its argmax, the sampler's token at temperature 0); returns ``[seqs]``
    int64 tokens (the first ``len(draws)`` are the step's)."""
    tokens, seqs = shape
    logits = forward(buffers.metadata(tokens, seqs), kv_caches)[buffers.draw_rows[:seqs]]  # [seqs, vocab]
    if greedy:
        return logits.argmax(dim=-1)
    return sampler(logits, buffers.temperature[:seqs], buffers.top_p[:seqs], buffers.seeds[:seqs],
                   buffers.sample_positions[:seqs])
