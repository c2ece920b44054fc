"""Turns a scheduled step into device work: metadata, the forward, sampling, tokens back.

Two kinds of step (see :mod:`compiled_attn.scheduler` for what a chunk is):

* :meth:`ModelRunner.launch_chunks`: any mix of prefill chunks and decode rows in **one**
  forward over the paged cache (the attention ops serve mixed batches), metadata packed on
  the host (:func:`~compiled_attn.metadata.pack_chunks`), a CUDA-graph replay when the step
  fits a captured ``(tokens, seqs)`` shape (:mod:`compiled_attn.mixed_graphs`), the compiled
  model otherwise; its tokens stay on the device until the engine reads them, and decode
  rows may take their input token from a decode step still in flight;
* :meth:`ModelRunner.launch_decode`: one token for each of the running requests through the
  static decode buffers, a CUDA-graph replay when graphs are on and the batch fits a capture
  size (the compiled model otherwise), returned in flight (:class:`InflightStep`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.profiler import record_function

from .graphs import CaptureStats, CUDAGraphRunner, decode_step
from .kv_cache import KVCache
from .metadata import SequenceChunk, column_to_device, pack_chunks
from .mixed_graphs import mixed_step
from .ops import copy_blocks
from .scheduler import Chunk, Request
from .step_inputs import DecodeBuffers, MixedBuffers


@dataclass
class InflightStep:
    """A launched decode step whose tokens the host has not read yet.

    Attributes:
        requests: the requests of its rows, in row order.
        tokens: its sampled tokens ``[rows]`` on the host: pinned memory that a
            non-blocking device-to-host copy fills (CUDA), or the tokens themselves (CPU).
        event: recorded on the stream after that copy; ``None`` on the CPU, where the
            tokens are ready at once.
        device_tokens: the same tokens where the step left them (int64 ``[rows]``), for a
            step launched behind this one to read on the device (valid until the next
            decode step).
        start: recorded on the stream just before the step (CUDA; ``None`` on the CPU):
            ``start`` to ``event`` times the step, and ``start`` completes when the stream
            reaches it (the device was idle before, or the work ahead of it is done).
        stand_ins: its rows' output ends in a stand-in for its token, which the read
            replaces (set by the engine when it launches a mixed step behind this one).
        started_at: host ``time.perf_counter()`` when ``start`` was first seen complete
            (:meth:`started`), else ``None``.
    """

    requests: list[Request]
    tokens: torch.Tensor
    event: torch.cuda.Event | None
    device_tokens: torch.Tensor
    start: torch.cuda.Event | None = None
    stand_ins: bool = False
    started_at: float | None = None

    @staticmethod
    def mark_start(device: torch.device) -> torch.cuda.Event | None:
        """An event recorded now on the current stream of a CUDA ``device`` (a step's
        ``start``, before it is launched); ``None`` for the CPU."""
        if device.type != "cuda":
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        return start

    @classmethod
    def launch(cls, requests: list[Request], tokens: torch.Tensor,
               start: torch.cuda.Event | None = None) -> "InflightStep":
        """Start copying the just-launched step's ``tokens`` to the host.

        The copy is enqueued on the stream behind the step and ahead of the next one, so it
        reads the step's tokens even when ``tokens`` is a graph's static output that the next
        replay overwrites: no device-side copy is needed.
        """
        if not tokens.is_cuda:
            return cls(requests, tokens, None, tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event(enable_timing=start is not None)
        event.record(torch.cuda.current_stream(tokens.device))
        return cls(requests, host, event, tokens, start)

    def ready(self) -> bool:
        """Whether :meth:`read` would return at once (always on the CPU)."""
        return self.event is None or self.event.query()

    def started(self) -> float | None:
        """Host time at which the device was first seen running the step (``None``: not
        yet, or no ``start`` event); the first call that sees ``start`` complete sets it."""
        if self.started_at is None and self.start is not None and self.start.query():
            self.started_at = time.perf_counter()
        return self.started_at

    def device_seconds(self) -> float | None:
        """Device seconds from ``start`` to ``event``, once both completed; else ``None``."""
        if self.start is None or not self.event.query():
            return None
        return self.start.elapsed_time(self.event) / 1e3

    def read(self) -> list[int]:
        """The tokens, once the copy (and so the step) has finished on the device."""
        if self.event is not None:
            self.event.synchronize()
        return self.tokens.tolist()


class ModelRunner:
    """Runs the model's steps over one KV cache.

    Args:
        forward: the model, or its compiled form (``forward(md, kv_caches)`` -> logits of
            each sequence's last token).
        sampler: :func:`~compiled_attn.sampling.sample` or its compiled form.
        kv_cache: the cache and its allocator.
        max_num_seqs: rows of the decode buffers (the largest decode batch).
        max_blocks_per_seq: block-table width of every step.
        capture_sizes: decode batch sizes to capture, or ``None`` for no CUDA graphs.
        mixed_capture_sizes: ``(tokens, seqs)`` shapes of mixed steps to capture
            (:func:`~compiled_attn.mixed_graphs.default_mixed_capture_sizes`), or ``None``
            / empty for none.
    """

    def __init__(self, forward, sampler, kv_cache: KVCache, max_num_seqs: int, max_blocks_per_seq: int,
                 capture_sizes: Sequence[int] | None,
                 mixed_capture_sizes: Sequence[tuple[int, int]] | None = None) -> None:
        self.forward, self.sampler, self.kv_cache = forward, sampler, kv_cache
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = kv_cache.layers[0][0].device
        self.buffers = DecodeBuffers(max_num_seqs, max_blocks_per_seq, kv_cache.block_size, self.device)
        self.capture_sizes = None if capture_sizes is None else [s for s in capture_sizes if s <= max_num_seqs]
        self.graph_runner: CUDAGraphRunner | None = None
        self.capture_stats: CaptureStats | None = None
        self.decode_layout: tuple[tuple[int, ...], int] | None = None  # (request ids, rows) in the buffers
        self._blocks_written: list[int] = []  # per buffer row, block-table entries written
        self.paged_prefill = False  # run pure prefills through the paged kernel too (the engine's warm-up)
        self.mixed_buffers = (MixedBuffers(mixed_capture_sizes, max_blocks_per_seq, self.device)
                              if mixed_capture_sizes else None)
        self.mixed_graphs: CUDAGraphRunner | None = None
        self.mixed_capture_stats: CaptureStats | None = None

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``(src, dst)`` in every layer (copy-on-write of shared blocks)."""
        if copies:
            self.decode_layout = None  # a row's block table changed in place: rewrite the buffers
            copy_blocks([layer[0] for layer in self.kv_cache.layers], [layer[1] for layer in self.kv_cache.layers],
                        torch.tensor(copies, dtype=torch.int64, device=self.device))

    def launch_chunks(self, chunks: list[Chunk], draws: list[tuple[int, Request]] | None = None,
                      feed: tuple[torch.Tensor, list[tuple[int, int]]] | None = None) -> torch.Tensor:
        """Launch one forward over ``chunks`` (prefill chunks and decode rows, in any mix);
        returns int64 ``[len(draws)]`` device tokens, one sampled per ``draws`` entry ``(chunk
        index, request whose sampling parameters and seed draw it)``, by default one per
        chunk with its own request (meaningful for chunks that complete their request).

        ``feed = (tokens, pairs)``: for each ``(chunk index, row)`` pair, that chunk is a
        decode row whose input token the host does not know yet (any id stands in for
        it): ``tokens[row]`` on the device is copied in, ahead of the forward (``tokens``:
        :attr:`InflightStep.device_tokens` of the decode step in flight)."""
        allocator = self.kv_cache.allocator
        packed = pack_chunks(
            [SequenceChunk(c.request.token_ids(c.request.num_computed, c.request.num_computed + c.num_tokens),
                           c.request.num_computed, allocator.block_tables[c.request.request_id]) for c in chunks],
            self.kv_cache.block_size, self.max_blocks_per_seq)  # (the allocator's ids: no range check per step)
        self.decode_layout = None  # the decode buffers no longer hold the rows' device state
        draws = [(i, r.params.temperature, r.params.top_p, r.seed, chunks[i].request.num_computed + chunks[i].num_tokens)
                 for i, r in (draws or [(i, c.request) for i, c in enumerate(chunks)])]
        shape = (self.mixed_buffers.padded_shape(packed.num_tokens, packed.num_seqs, len(draws))
                 if self.mixed_graphs is not None else None)

        def column(values, dtype):
            return column_to_device(values, dtype, self.device)

        # the fed decode rows: (their input_ids entry, their row in feed's tokens)
        fed = [(packed.cu_seqlens_q[chunk], row) for chunk, row in feed[1]] if feed is not None else []
        if shape is not None:
            greedy = all(temperature == 0 for _, temperature, *_ in draws)
            self.mixed_buffers.write(packed, shape, draws, greedy, fed)
            if fed:
                self.mixed_buffers.feed(feed[0], len(fed))
            with record_function("replay"):
                return self.mixed_graphs.replay(shape, greedy)[: len(draws)]
        md = packed.to_device(self.device)
        if fed:
            entries, rows = zip(*fed)
            md.input_ids.index_copy_(0, column(entries, torch.int64), feed[0].index_select(0, column(rows, torch.int64)))
        if self.paged_prefill:
            md.prefill_only = False

        rows, temperature, top_p, seeds, positions = zip(*draws)
        logits = self.forward(md, self.kv_cache.layers)
        if list(rows) != list(range(len(chunks))):
            logits = logits[column(rows, torch.int64)]
        return self.sampler(logits, column(temperature, torch.float32), column(top_p, torch.float32),
                            column(seeds, torch.int64), column(positions, torch.int64))

    def launch_decode(self, requests: list[Request], tables: list[list[int]], ahead: int) -> InflightStep:
        """Launch one decode step (one token for each of ``requests``, the running ones, whose
        block ``tables`` already hold this step's slots: :meth:`Scheduler.allocate_decode`)
        through the static decode buffers; returns it in flight.

        ``ahead`` is how many tokens the device is past the host's ``output_ids`` (1 while
        a step is in flight: its advance already moved the buffers), so this step feeds
        position ``num_tokens - 1 + ahead`` and its advance addresses the one after.
        """
        rows = len(requests)
        size = self.graph_runner.padded_size(rows) if self.graph_runner is not None else None
        layout = (tuple(r.request_id for r in requests), size or rows)
        if layout != self.decode_layout:
            assert ahead == 0, "decode rows change only after a drain, when the host is current"
            self.buffers.write([r.decode_row(table) for r, table in zip(requests, tables)], layout[1])
            self.decode_layout = layout
        else:  # blocks added since the buffers were written (here or by the scheduler)
            for row, table in enumerate(tables):
                for index in range(self._blocks_written[row], len(table)):
                    self.buffers.set_block(row, index, table[index])
        self._blocks_written = [len(table) for table in tables]
        greedy = all(r.params.temperature == 0 for r in requests)
        start = InflightStep.mark_start(self.device)
        if size is not None:
            with record_function("replay"):
                tokens = self.graph_runner.replay(size, greedy)[:rows]
        else:
            tokens = decode_step(self.forward, self.kv_cache.layers, self.buffers, rows, self.sampler, greedy)
        return InflightStep.launch(requests, tokens, start)

    def capture(self) -> CaptureStats:
        """Capture the decode step for every capture size (done once, before the first
        decode step; it compiles the decode graph first when compiling)."""
        def step(rows: int, greedy: bool) -> torch.Tensor:
            return decode_step(self.forward, self.kv_cache.layers, self.buffers, rows, self.sampler, greedy)

        with record_function("capture"):
            self.buffers.write([], self.buffers.max_rows)  # all padding while capturing
            runner = CUDAGraphRunner(step, self.capture_sizes)
            self.capture_stats = runner.capture()
        self.graph_runner, self.decode_layout = runner, None
        return self.capture_stats

    @property
    def mixed_capture_pending(self) -> bool:
        """Mixed-step shapes to capture and no graphs of them yet."""
        return self.mixed_buffers is not None and self.mixed_graphs is None

    def capture_mixed(self) -> CaptureStats:
        """Capture the mixed step for every ``(tokens, seqs)`` shape of the mixed buffers,
        into the decode graphs' memory pool (replays never overlap: each step's tokens are
        read before the next launch)."""
        def step(shape: tuple[int, int], greedy: bool) -> torch.Tensor:
            if not torch.cuda.is_current_stream_capturing():  # a warm-up run: valid padding of this shape
                self.mixed_buffers.write_padding(shape)
            return mixed_step(self.forward, self.kv_cache.layers, self.mixed_buffers, shape, self.sampler, greedy)

        with record_function("capture"):
            pool = None if self.graph_runner is None else self.graph_runner.pool
            runner = CUDAGraphRunner(step, self.mixed_buffers.sizes, pool=pool)
            self.mixed_capture_stats = runner.capture()
        self.mixed_graphs = runner
        return self.mixed_capture_stats
