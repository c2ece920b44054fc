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

import bisect
from typing import Callable, Sequence

import torch

from .metadata import AttentionMetadata, PackedChunks, write_buffers
from .ops import PAD_SLOT_ID

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


class MixedBuffers:
    """Static device buffers of a mixed step, at the largest captured shape.

    Args:
        sizes: the captured ``(tokens, seqs)`` shapes.
        max_blocks_per_seq: ``block_table`` width.
        device: where the buffers live.

    Attributes:
        input_ids, positions, slot_mapping: ``[max_tokens]`` int64.
        cu_seqlens_q: ``[max_seqs + 1]`` int32; seq_lens: ``[max_seqs]`` int32;
        block_table: ``[max_seqs, max_blocks_per_seq]`` int32.
        draw_rows: ``[max_seqs]`` int64 sequence (logits row) of each draw.
        temperature, top_p: ``[max_seqs]`` float32; seeds, sample_positions: ``[max_seqs]``
            int64 sampling inputs of each draw (see :func:`~compiled_attn.sampling.sample`).
    """

    def __init__(self, sizes: Sequence[tuple[int, int]], max_blocks_per_seq: int, device) -> None:
        self.sizes = sorted(set(sizes))
        self._tokens = sorted({t for t, _ in self.sizes})
        max_tokens = self._tokens[-1]
        max_seqs = max(s for _, s in self.sizes)

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids, self.positions = zeros(max_tokens), zeros(max_tokens)
        self.slot_mapping = torch.full((max_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.cu_seqlens_q = zeros(max_seqs + 1, dtype=torch.int32)
        self.seq_lens = zeros(max_seqs, dtype=torch.int32)
        self.block_table = zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32)
        self.draw_rows, self.seeds, self.sample_positions = zeros(max_seqs), zeros(max_seqs), zeros(max_seqs)
        self.temperature = zeros(max_seqs, dtype=torch.float32)
        self.top_p = torch.ones(max_seqs, device=device)

    def padded_shape(self, num_tokens: int, num_seqs: int, num_draws: int) -> tuple[int, int] | None:
        """The smallest captured ``(tokens, seqs)`` that holds a step of ``num_tokens``
        tokens in ``num_seqs`` sequences with ``num_draws`` draws (and a padding sequence
        for the pad tokens, if any); ``None`` when none does."""
        i = bisect.bisect_left(self._tokens, num_tokens)
        if i == len(self._tokens):
            return None
        tokens = self._tokens[i]
        seqs_needed = max(num_seqs + (tokens > num_tokens), num_draws)
        fitting = [s for t, s in self.sizes if t == tokens and s >= seqs_needed]
        return (tokens, min(fitting)) if fitting else None

    def metadata(self, tokens: int, seqs: int) -> AttentionMetadata:
        """Views of the buffers as a batch of ``tokens`` tokens in ``seqs`` sequences."""
        return AttentionMetadata(self.input_ids[:tokens], self.positions[:tokens], self.slot_mapping[:tokens],
                                 self.cu_seqlens_q[: seqs + 1], self.seq_lens[:seqs], self.block_table[:seqs])

    def write(self, packed: PackedChunks, shape: tuple[int, int], draws: Sequence[tuple[int, float, float, int, int]],
              greedy: bool = False) -> None:
        """Copy one step into the buffers, padded to ``shape`` (from :meth:`padded_shape`).

        ``draws`` holds ``(sequence, temperature, top_p, seed, position)`` per sampled
        token; ``greedy`` (every draw takes the argmax) writes their rows only. Only the
        step's own ``block_table`` rows, and in them the columns up to the longest
        (:func:`~compiled_attn.metadata.block_table_rows`), are written: a padding sequence
        has no keys, so its row is never read.
        """
        tokens, seqs = shape
        pad_tokens, pad_seqs, pad_draws = tokens - packed.num_tokens, seqs - packed.num_seqs, seqs - len(draws)
        rows, temperature, top_p, seeds, positions = (list(column) for column in zip(*draws)) if draws else [[]] * 5
        host = {
            "input_ids": packed.input_ids + [0] * pad_tokens,
            "positions": packed.positions + [0] * pad_tokens,
            "slot_mapping": packed.slot_mapping + [PAD_SLOT_ID] * pad_tokens,
            "cu_seqlens_q": packed.cu_seqlens_q + [tokens] * pad_seqs,
            "seq_lens": packed.seq_lens + [0] * pad_seqs,
            "draw_rows": rows + [0] * pad_draws,
        }
        if not greedy:
            host.update(temperature=temperature + [0.0] * pad_draws, top_p=top_p + [1.0] * pad_draws,
                        seeds=seeds + [0] * pad_draws, sample_positions=positions + [0] * pad_draws)
        write_buffers(self, host, packed.block_table)

    def write_padding(self, shape: tuple[int, int]) -> None:
        """Write a step of ``shape`` that is all padding (what capturing runs on: the
        attention kernels need ``cu_seqlens_q`` to end at the token count)."""
        self.write(PackedChunks([], [], [], [0], [], [], self.block_table.shape[1], prefill_only=False), shape, [])


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
