"""Decode steps as captured CUDA graphs: capture sizes, the step, capture and replay.

A decode step (forward + sampling + advancing the metadata to the next token) is one
function of static buffers (:class:`~compiled_attn.step_inputs.DecodeBuffers`) sized for
the largest batch. :class:`CUDAGraphRunner` captures and replays it, and mixed steps too
(:mod:`compiled_attn.mixed_graphs`). For each
capture size ``n`` the step over the first ``n`` rows is captured once (largest first,
into one shared memory pool, after warm-up runs that keep Triton autotuning and
compilation out of the graph). A real batch of ``b`` rows replays the graph of the
smallest size ``n >= b``; rows ``b .. n-1`` are padding with kernel-safe values
(``seq_len`` 0, slot ``PAD_SLOT_ID``, greedy; their block-table rows keep whatever valid ids
they held), which attend to nothing, write nothing and produce zeros, never NaN. Without
graphs (CPU, batches above the largest size) the same step function runs directly on ``b``
rows.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .sampling import sample
from .step_inputs import DecodeBuffers, advance


def default_capture_sizes(max_batch_size: int = 256) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to ``max_batch_size`` (included), as vLLM."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 8))
    return sorted(set(sizes) | {max_batch_size})


def decode_step(forward: Callable, kv_caches, buffers: DecodeBuffers, rows: int,
                sampler: Callable = sample, greedy: bool = False) -> torch.Tensor:
    """Forward, sample (with ``sampler``, :func:`~compiled_attn.sampling.sample` or its
    compiled form) and advance the first ``rows`` rows; returns ``[rows]`` int64 tokens.

    ``greedy=True`` (every row has temperature 0) takes the argmax instead of running the
    sampler, which is the same token without the sort and noise (vLLM's ``all_greedy``)."""
    md = buffers.metadata(rows)
    logits = forward(md, kv_caches)
    if greedy:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = sampler(logits, buffers.temperature[:rows], buffers.top_p[:rows], buffers.seeds[:rows],
                        md.positions + 1)
    advance(md, tokens, buffers.block_size)
    return tokens


@dataclass
class CaptureStats:
    """What capturing cost: sizes captured, wall seconds (warm-ups and compilation
    included), and the bytes of the graphs' shared memory pool (the caching allocator's
    segments owned by that pool)."""

    sizes: list[int]
    seconds: float
    memory_bytes: int


class CUDAGraphRunner:
    """Captures ``step(size, greedy)`` once per size and sampling variant (``greedy``: all
    rows take the argmax) and replays the smallest fitting graph.

    Args:
        step: runs one step over static buffers of ``size`` (decode: the first ``size``
            rows; a mixed step: a ``(tokens, seqs)`` pair) and returns a tensor (the
            sampled tokens); called for warm-up and inside the capture.
        sizes: capture sizes (ints or tuples; captured largest first).
        warmup_steps: eager calls per size before its capture.
        pool: the memory pool to capture into (``torch.cuda.graph_pool_handle()``; graphs
            of several runners may share one when their replays never overlap); a new one
            by default.
    """

    def __init__(self, step: Callable[..., torch.Tensor], sizes: Sequence, warmup_steps: int = 2,
                 pool=None) -> None:
        self.step = step
        self.sizes = sorted(set(sizes))
        self.warmup_steps = warmup_steps
        self.pool = pool
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, rows: int) -> int | None:
        """Smallest capture size ``>= rows``; ``None`` when ``rows`` exceeds the largest."""
        i = bisect.bisect_left(self.sizes, rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture(self) -> CaptureStats:
        """Capture every size and both sampling variants, largest first, into one memory pool.

        Raises:
            RuntimeError: a capture failed (typically out of memory); the message names
                the size and what to lower.
        """
        start = time.perf_counter()
        pool = self.pool = self.pool or torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size, greedy in itertools.product(reversed(self.sizes), (False, True)):
            try:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(self.warmup_steps):
                        self.step(size, greedy)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.step(size, greedy)
                graph.replay()  # its first launch uploads it: here, not in a request's step
            except torch.OutOfMemoryError as err:
                raise RuntimeError(
                    f"CUDA-graph capture of size {size} ran out of memory; lower the largest "
                    f"capture sizes, the KV-cache blocks, or turn graphs off"
                ) from err
            self.graphs[size, greedy] = (graph, out)
        torch.cuda.synchronize()
        pool_bytes = sum(segment["total_size"] for segment in torch.cuda.memory_snapshot()
                         if tuple(segment.get("segment_pool_id", ())) == tuple(pool))
        return CaptureStats(list(self.sizes), time.perf_counter() - start, pool_bytes)

    def replay(self, size: int, greedy: bool = False) -> torch.Tensor:
        """Replay the graph of ``size`` (and sampling variant) on the current stream; returns
        its static output.

        The tensor is the graph's own, not a copy: the next replay of any size may overwrite
        it (the graphs share one memory pool). Read it by work enqueued on the same stream
        before that replay, e.g. a non-blocking copy to host memory, as the engine does.
        """
        graph, out = self.graphs[size, greedy]
        graph.replay()
        return out
